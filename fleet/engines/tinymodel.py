"""Generate a tiny random-weights Llama model so real vLLM can run without a GPU or a model hub.

``make_tiny_model(out_dir)`` writes a complete Hugging Face model directory: a byte-level BPE
tokenizer trained offline on a small built-in corpus (with a chat template and
bos/eos/pad/unk tokens) and a 4-layer ``LlamaForCausalLM`` with seeded random weights, stored as
safetensors (a few MB). vLLM (including the CPU build) loads and serves it like any other Llama,
so every request goes through the real scheduler, KV cache, sampler, OpenAI-compatible API and
Prometheus metrics. The model has never been trained: its output is noise, useful only for
exercising the serving stack.

Nothing touches the network, and the result is deterministic for a given ``seed`` and
``vocab_size``. ``torch``, ``transformers`` and ``tokenizers`` are imported only when a model
is actually generated, so importing this module is cheap.

Command line: ``python -m fleet.engines.tinymodel OUT_DIR`` prints the model directory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

__all__ = ["MARKER_FILE", "make_tiny_model", "make_tiny_tokenizer", "main"]

#: Written last into a finished model directory; holds the generation parameters.
MARKER_FILE = "fleet-tiny-model.json"

# Bump when the generated files change in a way that should invalidate existing directories.
_FORMAT_VERSION = 1

_BOS, _EOS, _UNK, _PAD = "<s>", "</s>", "<unk>", "<pad>"
_ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
_SPECIAL_TOKENS = [_BOS, _EOS, _UNK, _PAD, *_ROLE_TOKENS]

# Llama-ish: bos, then each message as "<|role|>\ncontent</s>\n"; the generation prompt opens
# an assistant turn.
_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_MODEL_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}

# Files that must exist for a directory to count as a complete model.
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

_CORPUS = """\
An inference fleet runs many copies of a language model behind one endpoint. Each replica is a
process that loads the weights, reserves memory for the key-value cache, and answers requests
over an HTTP interface compatible with the OpenAI API. A router spreads the traffic: it prefers
the replica with the shortest queue, keeps requests that share a prompt prefix on the same
replica so the cache can be reused, and stops sending work to a replica whose health check
fails. An autoscaler watches the number of running and waiting requests, the time to first
token, and the cache usage, and it adds or removes replicas when the load changes.

Placement decides where a new replica goes. A machine has a number of accelerators, an amount
of memory, a set of processor cores and a network link. The placer fits replicas so that no
device is oversubscribed, spreads copies of the same model across failure domains, and leaves
headroom for a sudden burst. Warmup loads the weights, compiles the kernels, captures graphs
and sends a few synthetic requests before the replica is marked ready, so that the first real
user does not pay for the cold start.

The scheduler inside each engine builds a batch at every step. Prefill processes the prompt
tokens of new requests; decode produces one token for every running sequence. Chunked prefill
splits long prompts so that decoding sequences are not starved. When the cache is full, the
scheduler preempts the youngest sequence, frees its blocks and recomputes them later. Sampling
applies temperature, top-p, top-k, repetition penalties and stop strings, and streams each new
token back to the client as a server-sent event.

Metrics are exported in the Prometheus text format: counters for prompt and generation tokens,
gauges for running and waiting requests, and histograms for latency, queue time, time per
output token and end-to-end request duration. Labels carry the model name and the engine index.
Logs record every start, every failure and every shutdown, with timestamps, process
identifiers, exit codes and the last lines written to standard error.

Operators ask simple questions. Is the service up? How long does a cold start take? Which
replica is slow, and why? What happens when a process is killed, when a disk fills, when a
configuration file is malformed, or when two servers try to bind the same port? Good tooling
answers quickly, prints clear messages, cleans up child processes, retries with backoff, and
never loses a request silently.

def handle(request, *, timeout=30.0):
    if request.stream:
        for chunk in engine.generate(request.prompt, max_tokens=request.max_tokens):
            yield {"id": request.id, "choices": [{"index": 0, "text": chunk}]}
    else:
        result = await engine.complete(request.prompt, temperature=0.7, top_p=0.95)
        return {"id": request.id, "usage": {"prompt_tokens": 12, "completion_tokens": 34}}

class Replica:
    name: str
    port: int = 8000
    healthy: bool = False
    def __repr__(self) -> str:
        return f"Replica(name={self.name!r}, port={self.port}, healthy={self.healthy})"

$ curl -s http://127.0.0.1:8000/v1/models | jq '.data[0].id'
$ curl -s http://127.0.0.1:8000/metrics | grep '^vllm:num_requests_running'
[2024-05-17 09:41:08] INFO: Started server process [4242]; waiting for application startup.
[2024-05-17 09:41:09] WARNING: 3 requests waiting, 97.5% cache usage, p99 latency 1.82s.
[2024-05-17 09:41:10] ERROR: replica-7 exited with code 1 (OSError: [Errno 98] address in use)

Numbers and units: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 8192 65536,
0.5 1.25 3.14159 2.71828 99.9%, 12 ms, 250 MB, 1.5 GiB, 80 GB, 3 kHz, 2 GHz, 1e-5, 0x7fff.
Punctuation and symbols: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? @ # $ : ; , . ' " ` \\ _

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. Sphinx of
black quartz, judge my vow. How vexingly quick daft zebras jump! The five boxing wizards jump
quickly. Jackdaws love my big sphinx of quartz. Waltz, bad nymph, for quick jigs vex.

Spring arrives slowly in the northern valley. Snow melts on the hillsides, rivers swell, and
the first green shoots push through the cold soil. Farmers repair fences, mend tools, and wait
for the ground to dry before planting barley, oats, potatoes and beans. Swallows return from the
south; bees wake in their hives; children walk to school along muddy lanes, carrying books,
lunches and umbrellas. In the evening the village gathers in the square to hear music, trade
news, argue about the weather, and plan the summer market, the harvest festival and the long
autumn journey to the coast, where ships unload timber, salt, copper, wool, spices and letters
from distant cities.

A library is a quiet place full of stories. Historians study old maps, chemists measure
reactions, mathematicians prove theorems about primes, graphs, matrices and probability,
astronomers photograph galaxies, biologists sequence genomes, and engineers design bridges,
engines, circuits, compilers, databases and operating systems. Every discovery begins with a
question, continues with careful experiments, and ends with another, better question.
"""


def _corpus_lines() -> list[str]:
    """The training text: the built-in corpus plus a deterministic word-combination section."""
    lines = _CORPUS.splitlines()
    words = sorted({w.strip(".,;:!?()[]{}\"'`").lower() for w in _CORPUS.split()} - {""})
    # Pair each word with a few others in a fixed pattern: more distinct byte pairs for the BPE
    # trainer to merge, so the vocabulary reaches its target size.
    n = len(words)
    for step in (1, 7, 31):
        lines.append(" ".join(words[i] + words[(i + step) % n] for i in range(n)))
    lines.extend(f"{i} {i * 37 % 1000:03d} {i:x} {i:o}" for i in range(1000))
    return lines


def _params(seed: int, vocab_size: int) -> dict:
    return {"format": _FORMAT_VERSION, "seed": seed, "vocab_size": vocab_size, **_MODEL_SHAPE}


def _is_complete(out_dir: Path, params: dict) -> bool:
    marker = out_dir / MARKER_FILE
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded == params and all((out_dir / f).is_file() for f in _REQUIRED_FILES)


def _build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=_UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    # If the corpus runs out of merges before the target, pad with plain added tokens so that
    # the tokenizer covers every id the model can emit (vLLM detokenizes sampled ids).
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    bos_id = tok.token_to_id(_BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{_BOS} $A", pair=f"{_BOS} $A {_BOS} $B", special_tokens=[(_BOS, bos_id)]
    )

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=_BOS,
        eos_token=_EOS,
        unk_token=_UNK,
        pad_token=_PAD,
        additional_special_tokens=list(_ROLE_TOKENS),
        chat_template=_CHAT_TEMPLATE,
        model_max_length=_MODEL_SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def make_tiny_tokenizer(out_dir: Path, *, vocab_size: int = 2048) -> Path:
    """Write only the tiny model's tokenizer (tokenizer.json, tokenizer_config.json,
    chat_template.jinja; the same files `make_tiny_model` writes) into ``out_dir``; returns it.
    Needs ``tokenizers`` and ``transformers``, not torch: a few seconds."""
    from transformers.utils import logging as hf_logging

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        _build_tokenizer(vocab_size).save_pretrained(out_dir)
    finally:
        hf_logging.set_verbosity(verbosity)
    return out_dir


def make_tiny_model(out_dir: Path, *, seed: int = 0, vocab_size: int = 2048) -> Path:
    """Write a tiny random-weights Llama model (tokenizer included) into ``out_dir``.

    Returns ``out_dir``. If ``out_dir`` already holds a complete model generated with the same
    parameters (recorded in ``fleet-tiny-model.json``), nothing is rewritten. Prints nothing.
    """
    out_dir = Path(out_dir)
    if vocab_size < 512:
        raise ValueError(f"vocab_size must be at least 512, got {vocab_size}")
    params = _params(seed, vocab_size)
    if _is_complete(out_dir, params):
        return out_dir

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKER_FILE).unlink(missing_ok=True)  # incomplete until rewritten at the end

    verbosity = hf_logging.get_verbosity()
    progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = _build_tokenizer(vocab_size)
        assert len(tokenizer) == vocab_size, (len(tokenizer), vocab_size)
        tokenizer.save_pretrained(out_dir)

        config = LlamaConfig(
            vocab_size=vocab_size,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            **_MODEL_SHAPE,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        model = model.to(torch.bfloat16)
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
        model.save_pretrained(out_dir)
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress_bars:
            hf_logging.enable_progress_bar()

    tmp = out_dir / (MARKER_FILE + ".tmp")
    tmp.write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / MARKER_FILE)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m fleet.engines.tinymodel",
        description="Generate a tiny random-weights Llama model (output is noise) for vLLM.",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args(argv)
    path = make_tiny_model(args.out_dir, seed=args.seed, vocab_size=args.vocab_size)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
