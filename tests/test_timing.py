"""jax_flash.time_attention and the benchmark entry point, on the CPU handler (the GPU numbers come from the
benchmark itself, not from timed tests)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import benchmark
from jax_flash import timing
from jax_flash.timing import calls_per_rep, time_loop_ms, timed_loop
from conftest import random_qkv

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("loop", ["unrolled", "while"])
def test_time_loop_ms_runs_both_loop_forms(loop):
    q, k, v = random_qkv(3, 1, 64, 64, 2, 2, 32, jnp.float32, jax.devices("cpu")[0])
    ms = time_loop_ms(jax_flash.attention, q, k, v, iters=3, reps=2, loop=loop)
    assert np.isfinite(ms) and ms > 0
    hlo = timed_loop(jax_flash.attention, iters=3, loop=loop).lower(q, k, v).compile().as_text()
    # unrolled: three chained custom calls and no while loop (whose condition XLA evaluates every iteration)
    assert ("while" in hlo) == (loop == "while")
    if loop == "unrolled":
        assert hlo.count("custom_call_target=") == 3


def test_time_loop_ms_rejects_unknown_loop():
    q, k, v = random_qkv(3, 1, 8, 8, 1, 1, 32, jnp.float32, jax.devices("cpu")[0])
    with pytest.raises(ValueError, match="loop='scan' is not allowed; choose 'while' or 'unrolled'"):
        time_loop_ms(lambda q, k, v: q, q, k, v, loop="scan")


def test_calls_per_rep():
    assert calls_per_rep(2.0, 0.0) == 1 and calls_per_rep(2.0, -5.0) == 1  # disabled
    assert calls_per_rep(2.0, 25.0) == 13  # ceil(25 / 2)
    assert calls_per_rep(30.0, 25.0) == 1  # one loop is already long enough
    assert calls_per_rep(0.0, 25.0) == 1000  # capped


def test_min_rep_ms_repeats_the_loop_within_each_repetition(monkeypatch):
    # A loop that takes >= 4 ms on the host: a 20 ms repetition needs 2-5 of them (calibrated on the second warm-up
    # call), each repetition dispatches that many, and the reported time is per fn call (iters of them per loop).
    real = timing.timed_loop
    invocations = []

    def slow_timed_loop(fn, *, iters, loop):
        jitted = real(fn, iters=iters, loop=loop)

        def call(q, k, v):
            invocations.append(1)
            time.sleep(0.004)
            return jitted(q, k, v)
        return call

    monkeypatch.setattr(timing, "timed_loop", slow_timed_loop)
    q, k, v = random_qkv(3, 1, 8, 8, 1, 1, 32, jnp.float32, jax.devices("cpu")[0])
    ms = time_loop_ms(lambda q, k, v: q, q, k, v, iters=2, reps=3, min_rep_ms=20.0)
    calls = (len(invocations) - 2) // 3
    assert len(invocations) == 2 + 3 * calls and 2 <= calls <= 5
    assert 2.0 <= ms < 10.0  # >= 4 ms per loop of 2 calls; the repetitions are not summed into one call
    invocations.clear()
    time_loop_ms(lambda q, k, v: q, q, k, v, iters=2, reps=3)  # default: one loop per repetition
    assert len(invocations) == 2 + 3


def test_time_interleaved_ms_rotates_rounds_and_reports_failures(monkeypatch):
    # Each round takes one repetition of every implementation still standing, each after an untimed one of the same
    # implementation, the first one rotating; one that fails to build is reported and never sampled, one that fails
    # in a round is reported and dropped from then on.
    sampled = []

    class Recorded:
        def __init__(self, fn, q, k, v, *, iters, loop, min_rep_ms):
            if fn == "broken":
                raise RuntimeError("no kernel for this shape")
            self.name = fn

        def sample_ms(self):
            sampled.append(self.name)
            if self.name == "late" and sampled.count("late") == 4:
                raise RuntimeError("failed in its second timed repetition")
            return {"a": 1.0, "b": 2.0 + len(sampled), "late": 3.0}[self.name]

    monkeypatch.setattr(timing, "_Repetitions", Recorded)
    names = ["a", "b", "broken", "late"]
    times, failures = timing.time_interleaved_ms({n: n for n in names}, None, None, None, reps=3)
    assert sampled == ["a", "a", "b", "b", "late", "late",  # round 0
                       "b", "b", "late", "late", "a", "a",  # round 1: late fails in its timed repetition
                       "a", "a", "b", "b"]  # round 2
    # b: the median of its timed repetitions, 2+4, 2+8, 2+16 (the untimed ones, 2+3, 2+7, 2+15, are not counted)
    assert times == {"a": 1.0, "b": 2.0 + 8} and set(failures) == {"broken", "late"}
    assert "no kernel" in str(failures["broken"]) and "second timed repetition" in str(failures["late"])
    with pytest.raises(ValueError, match="loop='scan' is not allowed"):
        timing.time_interleaved_ms({"a": "a"}, None, None, None, loop="scan")


def test_time_interleaved_ms_times_real_loops():
    q, k, v = random_qkv(3, 1, 64, 64, 2, 2, 32, jnp.float32, jax.devices("cpu")[0])
    times, failures = timing.time_interleaved_ms({"flash": jax_flash.attention, "identity": lambda q, k, v: q},
                                                 q, k, v, iters=2, reps=3)
    assert failures == {} and set(times) == {"flash", "identity"}
    assert all(np.isfinite(ms) and ms > 0 for ms in times.values())


def test_time_attention_returns_the_output_and_a_time():
    q, k, v = random_qkv(5, 2, 48, 80, 4, 2, 64, jnp.float32, jax.devices("cpu")[0])
    out, ms = jax_flash.time_attention(q, k, v, iters=2, reps=2)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax_flash.attention(q, k, v)))
    assert np.isfinite(ms) and ms > 0


@pytest.mark.parametrize("order", ["sequential", "interleaved"])
def test_benchmark_writes_rows_for_every_case(tmp_path, capsys, order):
    path = tmp_path / "bench.json"
    dtype = "bf16" if jax.default_backend() == "gpu" else "fp32"  # the default backend's own path
    assert benchmark.main(["--dtypes", dtype, "--head-dims", "64", "--seqs", "64,128", "--tokens", "128",
                           "--hidden", "128", "--causal", "both", "--iters", "1", "--reps", "2",
                           "--order", order, "--json", str(path)]) == 0
    written = json.loads(path.read_text())
    assert written["timing"] == {"iters": 1, "reps": 2, "loop": "unrolled",
                                 "min_rep_ms": 25.0 if jax.default_backend() == "gpu" else 0.0, "order": order}
    rows = written["rows"]
    assert [(r["seq"], r["causal"]) for r in rows] == [(64, False), (128, False), (64, True), (128, True)]
    for r in rows:
        assert {"jax_flash", "xla"} <= set(r["results"]) and r["results"]["jax_flash"]["tflops"] > 0
    captured = capsys.readouterr()
    # each row's numbers on stderr as soon as it is measured (a run cut short keeps them)
    measured = [line for line in captured.err.splitlines() if line.startswith("    jax_flash ")]
    assert len(measured) == len(rows) and all(" ms" in line and "xla " in line for line in measured)
    if jax.default_backend() == "gpu":
        assert "TFLOP/s" in captured.out
    else:  # milliseconds and GFLOP/s, with the machine's matmul rate as the ceiling
        assert written["platform"] == "cpu" and written["matmul_gflops"] > 0 and "cores)" in written["device"]
        assert "ms and GFLOP/s on" in captured.out


def test_backward_step_is_dq_plus_one_element_of_dk_and_dv():
    """The timed forward + backward step: dq of sum(out * q) plus 1e-3 (dk + dv) of their first elements (dk and dv
    computed, with no reduction over them)."""
    q, k, v = random_qkv(9, 2, 40, 40, 4, 2, 32, jnp.float32, jax.devices("cpu")[0])
    step = jax.jit(benchmark._with_backward(lambda q, k, v: jax_flash.attention(q, k, v, causal=True)))(q, k, v)

    def loss(q, k, v):
        return (jax_flash.attention(q, k, v, causal=True) * jax.lax.stop_gradient(q)).sum()

    dq, dk, dv = (np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    touch = 1e-3 * (dk[0, 0, 0, 0] + dv[0, 0, 0, 0])
    assert abs(touch) > 1e-6
    step = np.asarray(step)
    assert step.shape == q.shape and step.dtype == q.dtype
    np.testing.assert_allclose(step, dq + touch, rtol=1e-6, atol=1e-7)


def test_benchmark_fp8_rows_time_the_fp8_call_beside_bfloat16(tmp_path):
    """--dtypes fp8: jax_flash on float8_e4m3fn inputs beside jax_flash on the same values in bfloat16 (and cuDNN on
    them where there is a GPU)."""
    path = tmp_path / "bench.json"
    assert benchmark.main(["--dtypes", "fp8", "--head-dims", "64", "--seqs", "64", "--tokens", "64", "--hidden",
                           "128", "--causal", "on", "--iters", "1", "--reps", "1", "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["dtype"] == "fp8" and {"jax_flash", "jax_flash_bf16"} <= set(row["results"])
    assert all(r["tflops"] > 0 for r in row["results"].values())
    with pytest.raises(SystemExit):
        benchmark.main(["--dtypes", "fp8", "--pass", "backward"])


def test_benchmark_softcap_rows_beside_the_call_without(tmp_path):
    """--softcap: a jax_flash_softcap column beside jax_flash without it, and the softcap in the JSON, which
    tools/readme_table.py renders as a softcap table."""
    path = tmp_path / "bench.json"
    dtype = "bf16" if jax.default_backend() == "gpu" else "fp32"
    assert benchmark.main(["--dtypes", dtype, "--head-dims", "64", "--seqs", "64", "--tokens", "64", "--hidden",
                           "128", "--causal", "off", "--softcap", "30", "--iters", "1", "--reps", "1", "--json",
                           str(path)]) == 0
    written = json.loads(path.read_text())
    (row,) = written["rows"]
    assert written["softcap"] == 30.0 and {"jax_flash", "jax_flash_softcap"} <= set(row["results"])
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "tools" / "readme_table.py")
    readme_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme_table)
    table = readme_table.render_softcap(written)
    assert "softcap 30:" in table and f"| {row['results']['jax_flash_softcap']['tflops']:.0f}" in table


def test_benchmark_help_lists_every_option(capsys):
    # argparse %-formats each help text: a bare % in one made --help raise instead of printing
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--suite" in out and "% of copy" in out


def test_benchmark_dtype_names(capsys):
    # jnp names are accepted as the short ones; anything else is refused by argparse with the allowed names
    assert benchmark._dtype_list("bfloat16,float16, fp32") == ["bf16", "fp16", "fp32"]
    with pytest.raises(SystemExit):
        benchmark.main(["--dtypes", "int8"])
    err = capsys.readouterr().err
    assert "dtype 'int8' is not supported; choose from bf16, fp16, fp32, fp8" in err


def test_ring_benchmark_writes_ring_gather_and_scaling_rows(tmp_path, capsys):
    if len(jax.devices()) < 2:  # (CPU: conftest.py's 8 virtual devices)
        pytest.skip(f"the ring suite needs 2 devices of the default backend; {len(jax.devices())} visible")
    path = tmp_path / "ring.json"
    assert benchmark.main(["--suite", "ring", "--ring-seqs", "256", "--devices", "1,2", "--causal", "on",
                           "--iters", "1", "--reps", "1", "--min-rep-ms", "0", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["kind"], r["devices"], r["impl"]) for r in rows] == [
        ("sequence", 1, "one device"), ("sequence", 2, "ring"), ("sequence", 2, "gather"),
        ("batch", 1, "one device"), ("batch", 2, "batch")]
    assert all(r["ms"] > 0 and r["speedup"] > 0 and r["causal"] for r in rows)
    assert "Ring attention on" in capsys.readouterr().out


def test_short_suite_times_the_model_shapes(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(benchmark, "SHORT_SHAPES", (("vit", 3, 17, 2, 64), ("many heads", 40, 8, 3, 64)))
    path = tmp_path / "short.json"
    dtype = "bf16" if jax.default_backend() == "gpu" else "fp32"
    assert benchmark.main(["--suite", "short", "--dtypes", dtype, "--causal", "off", "--iters", "1", "--reps", "1",
                           "--min-rep-ms", "0", "--json", str(path)]) == 0
    written = json.loads(path.read_text())
    assert written["suite"] == "short"
    assert [(r["model"], r["batch"], r["seq"], r["heads"]) for r in written["rows"]] == [("vit", 3, 17, 2),
                                                                                          ("many heads", 40, 8, 3)]
    assert all(r["results"]["jax_flash"]["tflops"] > 0 for r in written["rows"])



def test_packed_suite_gives_pallas_the_same_problem(monkeypatch):
    """The GPU-only Pallas column gets the packed call's segment ids, scale and causal mask: run in Pallas's
    interpreter on CPU, it matches the packed call."""
    pallas_attention = pytest.importorskip("jax.experimental.pallas.ops.gpu.attention")
    from jax_flash import benchmark_packed

    mha = pallas_attention.mha
    monkeypatch.setattr(pallas_attention, "mha", lambda *args, **kwargs: mha(*args, interpret=True, **kwargs))
    ids = np.repeat(np.arange(4, dtype=np.int32), [20, 50, 30, 28])  # 128 tokens: Pallas's default 128-row blocks
    impls = benchmark_packed._implementations(ids, 32, on_gpu=True)
    assert {"packed", "unpacked", "cudnn", "xla", "pallas"} <= set(impls)
    with jax.default_device(jax.devices("cpu")[0]):  # (float32: the CPU path, also where a GPU is the default)
        q, k, v = (jax.random.normal(key, (1, 128, 2, 64), jnp.float32)
                   for key in jax.random.split(jax.random.PRNGKey(3), 3))
        np.testing.assert_allclose(impls["pallas"](q, k, v), impls["packed"](q, k, v), atol=2e-5)


def test_packed_suite_counts_visible_pairs(tmp_path, capsys):
    from jax_flash import benchmark_packed

    ids = np.array([0, 0, 0, 1, 1, 2], np.int32)
    assert benchmark_packed.visible_pairs(ids) == 6 + 3 + 1  # causal pairs inside documents of 3, 2 and 1 tokens
    doc_ids = benchmark_packed.document_ids(4096, 256, seed=1)
    assert doc_ids[0] == 0 and (np.diff(doc_ids) >= 0).all() and 5 <= doc_ids[-1] + 1 <= 40
    path = tmp_path / "packed.json"
    dtype = "bf16" if jax.default_backend() == "gpu" else "fp32"
    assert benchmark.main(["--suite", "packed", "--dtypes", dtype, "--packed-tokens", "512", "--packed-means", "64",
                           "--iters", "1", "--reps", "1", "--min-rep-ms", "0", "--json", str(path)]) == 0
    written = json.loads(path.read_text())
    assert written["suite"] == "packed"
    (row,) = written["rows"]
    assert row["tokens"] == 512 and row["mean"] == 64
    assert {"packed", "unpacked", "xla"} <= set(row["results"]) and all(r["tflops"] > 0 for r in row["results"].values())
    assert "Packed causal rows on" in capsys.readouterr().out


def test_packed_suite_times_the_backward(tmp_path):
    """--pass backward: each implementation's backward (forward + backward - forward) over 2.5x the visible pairs'
    FLOPs, without XLA's dense-mask attention."""
    path = tmp_path / "packed.json"
    on_gpu = jax.default_backend() == "gpu"
    # (repetitions of 5 ms at least: a backward is forward + backward less forward, which one call of each at these
    # sizes can leave at or below zero, dropping the row's entry. On a GPU shared by test workers, calls of a few
    # microseconds do so too: there the backward of 16384 tokens takes hundreds.)
    tokens, mean = ("16384", "1024") if on_gpu else ("256", "64")
    assert benchmark.main(["--suite", "packed", "--pass", "backward", "--dtypes", "bf16" if on_gpu else "fp32",
                           "--packed-tokens", tokens, "--packed-means", mean, "--iters", "1", "--reps", "3",
                           "--min-rep-ms", "5", "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["pass"] == "backward" and "xla" not in row["results"]
    assert {"packed", "unpacked"} <= set(row["results"]) and all(r["ms"] > 0 for r in row["results"].values())


def test_tensors_suite_times_alibi_slopes_beside_the_bias_they_stand_for(tmp_path):
    """The ALiBi rows compute one result: the (1, N, T, S) bias tensor and the slopes it is built from."""
    from jax_flash import benchmark_tensors

    cases = {name: impls for name, _, impls in benchmark_tensors._cases(64, 2, on_gpu=False)}
    with jax.default_device(jax.devices("cpu")[0]):  # (float32: the CPU path, also where a GPU is the default)
        q, k, v = (jax.random.normal(key, (2, 64, benchmark_tensors.HEADS, 32), jnp.float32)
                   for key in jax.random.split(jax.random.PRNGKey(4), 3))
        np.testing.assert_allclose(np.asarray(cases["ALiBi alibi_slopes (N,)"]["jax_flash"](q, k, v)),
                                   np.asarray(cases["ALiBi bias (1, N, T, S)"]["jax_flash"](q, k, v)), atol=1e-5)
    path = tmp_path / "tensors.json"
    dtype = "bf16" if jax.default_backend() == "gpu" else "fp32"
    assert benchmark.main(["--suite", "tensors", "--dtypes", dtype, "--tensor-seqs", "64", "--tokens", "128",
                           "--iters", "1", "--reps", "1", "--min-rep-ms", "0", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["case"] for r in rows][1:3] == ["ALiBi bias (1, N, T, S)", "ALiBi alibi_slopes (N,)"]
    assert all(v["tflops"] > 0 for r in rows for v in r["results"].values())


def test_tensors_suite_times_the_backward(tmp_path):
    path = tmp_path / "tensors_bwd.json"
    on_gpu = jax.default_backend() == "gpu"
    # (repetitions of 5 ms at least and, on a GPU, calls of hundreds of microseconds: as in the packed suite's test)
    seq, tokens = ("1024", "16384") if on_gpu else ("64", "128")
    assert benchmark.main(["--suite", "tensors", "--dtypes", "bf16" if on_gpu else "fp32", "--tensor-seqs", seq,
                           "--tokens", tokens, "--pass", "backward", "--iters", "1", "--reps", "3", "--min-rep-ms",
                           "5", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 4 and all(r["pass"] == "backward" for r in rows)
    assert all({"jax_flash"} <= set(r["results"]) and all(v["tflops"] > 0 for v in r["results"].values())
               for r in rows)
