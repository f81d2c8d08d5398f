"""The examples: 02_flax_module.py (the flax.nnx decoder with jax_flash attention matches Flax's default
attention), 04_decode.py, 05_train.py and 06_ring.py."""

from __future__ import annotations

import importlib.util
import pathlib
import types

import jax

import jax_flash

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "02_flax_module.py"


def load_example():
    spec = importlib.util.spec_from_file_location("flax_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flax_decoder_matches_default_attention():
    example = load_example()
    calls = []

    def counting_attention(*args, **kwargs):  # proves the flash path really runs jax_flash
        calls.append(kwargs)
        return jax_flash.attention(*args, **kwargs)

    example.jax_flash = types.SimpleNamespace(attention=counting_attention)
    with jax.default_device(jax.devices("cpu")[0]):  # the small version (head_dim 32) is the CPU one
        result = example.run(small=True)
    assert result["relative_max_diff"] < 3e-2, result
    assert len(calls) == 2 and all(c["causal"] and c["window"] == (32, -1) for c in calls)  # 2 layers, traced once
    assert set(result["ms"]) == {"jax_flash", "flax default"}


DECODE_EXAMPLE = EXAMPLE.parent / "04_decode.py"


def test_decode_example_greedy_tokens_match_flax_default():
    """examples/04_decode.py: the jitted generation loop over a contiguous and a paged cache gives the same greedy
    tokens with jax_flash as with Flax's default attention."""
    spec = importlib.util.spec_from_file_location("decode_example", DECODE_EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    calls = []

    def counting_attention(*args, **kwargs):
        calls.append(kwargs.get("page_table") is not None)
        return jax_flash.attention(*args, **kwargs)

    example.jax_flash = types.SimpleNamespace(attention=counting_attention, reference=jax_flash.reference)
    with jax.default_device(jax.devices("cpu")[0]):
        for page_size in (None, 16):
            result = example.run(small=True, page_size=page_size)
            assert (result["jax_flash"]["tokens"] == result["flax"]["tokens"]).all(), page_size
            assert result["jax_flash"]["tokens"].shape == (2, 20)
    assert calls and any(calls) and not all(calls)  # both layouts ran through jax_flash.attention


TRAIN_EXAMPLE = EXAMPLE.parent / "05_train.py"


def test_train_example_loss_curve_matches_flax_default():
    """examples/05_train.py: the decoder trains (the loss falls) and its loss curve with jax_flash equals the one with
    Flax's default attention from the same initial parameters."""
    spec = importlib.util.spec_from_file_location("train_example", TRAIN_EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with jax.default_device(jax.devices("cpu")[0]):
        flash = example.train("jax_flash", small=True, steps=200)
        default = example.train("flax", small=True, steps=200)
    assert flash["losses"][-1] < 0.1 * flash["losses"][0], flash["losses"][[0, -1]]
    assert abs(flash["losses"] - default["losses"]).max() < 1e-3


def test_ring_example_equals_one_device_and_only_permutes():
    """examples/06_ring.py: jit over sequence-sharded inputs, ring_attention in shard_map and the gradient all equal
    one device's call, with collective-permutes as the only collectives."""
    spec = importlib.util.spec_from_file_location("ring_example", EXAMPLE.parent / "06_ring.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with jax.default_device(jax.devices("cpu")[0]):
        results = example.run(seq=512, heads=4, head_dim=32, devices=jax.devices("cpu")[:4])
    assert results.pop("devices").startswith("4 x ")
    for name, (error, found, spec_text) in results.items():
        assert error < 1e-4, (name, error)
        assert found == ["collective-permute"], (name, found)
        assert "'sp'" in spec_text, (name, spec_text)
