"""MIG geometry rules (fleet.inventory.mig), checked against combinations from the NVIDIA MIG
user guide's placement tables."""

from __future__ import annotations

import pytest

from fleet.inventory.mig import MIG_MODELS, MigModel, MigProfile, MigSlot, check_geometry, fit_geometry, max_instances, mig_model_for

H100 = MIG_MODELS["h100-80gb"]
A100_40 = MIG_MODELS["a100-40gb"]


def slots(*pairs) -> list[MigSlot]:
    return [MigSlot(p, s) for p, s in pairs]


@pytest.mark.parametrize("geometry", [
    [("7g.80gb", 0)],
    [("4g.40gb", 0), ("3g.40gb", 4)],
    [("3g.40gb", 0), ("3g.40gb", 4)],
    [("2g.20gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)],
    [("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4), ("1g.10gb", 6)],
    [("1g.10gb", s) for s in range(7)],
    [("1g.20gb", 0), ("1g.20gb", 2), ("1g.20gb", 4), ("1g.20gb", 6)],
    [("4g.40gb", 0), ("1g.10gb+me", 4), ("1g.10gb", 5), ("1g.10gb", 6)],
])
def test_valid_h100_geometries(geometry):
    assert check_geometry(H100, slots(*geometry)) is None


@pytest.mark.parametrize("geometry, problem", [
    ([("3g.40gb", 2)], "cannot start at memory slice 2"),
    ([("4g.40gb", 0), ("3g.40gb", 0)], "overlaps"),
    ([("1g.10gb", 7)], "cannot start at memory slice 7"),
    ([("1g.10gb+me", 0), ("1g.10gb+me", 1)], "media extensions"),
    ([("3g.20gb", 0)], "not a MIG profile of NVIDIA H100 80GB"),
])
def test_invalid_h100_geometries(geometry, problem):
    assert problem in check_geometry(H100, slots(*geometry))


def test_the_compute_slice_budget_is_seven():
    # The real tables never exceed it through memory placements alone; a made-up profile that is
    # narrow in memory and wide in compute shows the rule is enforced on its own.
    model = MigModel("test", "Test GPU", (MigProfile("4g.20gb", 99, 4, 2, (0, 2, 4, 6)),))
    assert check_geometry(model, slots(("4g.20gb", 0))) is None
    assert "8 compute slices" in check_geometry(model, slots(("4g.20gb", 0), ("4g.20gb", 2)))
    assert max_instances(model, "4g.20gb") == (MigSlot("4g.20gb", 0),)


@pytest.mark.parametrize("model, profile, n", [
    (H100, "1g.10gb", 7), (H100, "1g.20gb", 4), (H100, "2g.20gb", 3), (H100, "3g.40gb", 2),
    (H100, "4g.40gb", 1), (H100, "7g.80gb", 1), (H100, "1g.10gb+me", 1),
    (A100_40, "1g.5gb", 7), (A100_40, "2g.10gb", 3), (A100_40, "3g.20gb", 2),
])
def test_max_instances_on_an_empty_gpu_matches_the_guide(model, profile, n):
    got = max_instances(model, profile)
    assert len(got) == n
    assert check_geometry(model, got) is None


def test_max_instances_beside_existing_ones():
    assert max_instances(H100, "3g.40gb", slots(("4g.40gb", 0))) == (MigSlot("3g.40gb", 4),)
    # 2g@0 + 2g@2 leave slices 4-7: one 3g fits (compute 2+2+3 = 7).
    assert max_instances(H100, "3g.40gb", slots(("2g.20gb", 0), ("2g.20gb", 2))) == (MigSlot("3g.40gb", 4),)
    assert max_instances(H100, "7g.80gb", slots(("1g.10gb", 3))) == ()


def test_fit_geometry_finds_starts_or_says_none():
    got = fit_geometry(H100, ["1g.10gb", "3g.40gb", "2g.20gb"])
    assert got is not None and check_geometry(H100, got) is None
    assert fit_geometry(H100, ["4g.40gb", "4g.40gb"]) is None
    assert fit_geometry(H100, ["3g.40gb"], slots(("3g.40gb", 0), ("3g.40gb", 4))) is None


@pytest.mark.parametrize("product, memory, key", [
    ("NVIDIA H100 80GB HBM3", 81559, "h100-80gb"),
    ("NVIDIA H100 PCIe", 81559, "h100-80gb"),
    ("NVIDIA A100-SXM4-40GB", 40960, "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", None, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 81920, "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", None, "a100-80gb"),
    ("NVIDIA H100 NVL", 95830, None),
    ("NVIDIA L40S", 46068, None),
])
def test_mig_model_for_products(product, memory, key):
    model = mig_model_for(product, memory)
    assert (model.key if model else None) == key
