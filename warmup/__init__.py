"""Warm-up: the plan a model owner declares, the warm-up run against a replica's engine, and the
readiness gate the controller consults before a replica joins the router's pool.

A replica is ready only when the engine's ``/health`` answers AND every warm-up request of its
plan succeeded through the engine's real OpenAI API (vLLM reports healthy before its first
requests are fast; see ../docs or shared notes on compilation and CUDA-graph capture).
"""
