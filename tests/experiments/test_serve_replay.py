"""The serving benchmarks' CPU-checkable parts: the paged-vs-contiguous kernel check of bench_paged.py (interpret
mode, tiny shape), the replay loop of serve_replay.py on a tiny random model, and the shared paged.json/md writer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experiments import bench_paged, paged_report  # the front ends: flag parsing, the replay's report writer
from experiments.timing import BenchShape
from kascade_jax.bench import paged, store, tables
from kascade_jax.bench import replay as serve_replay  # the replay's library (the front end's flags are shared ones)
from tests import cli_fork  # the CLI probes: forked from a server that has imported the libraries


def test_bench_paged_check_interpret(rng):
    shape = BenchShape(q_heads=4, kv_heads=2, head_dim=64, num_layers=4, num_anchors=2)
    seed = int(rng.integers(1 << 20))  # the seeded per-test generator (conftest)
    res = paged.check(1, 128, 16, shape, frac=0.2, min_k=16, seed=seed, interpret=True, anchor0=False)
    assert [c["name"] for c in res] == ["dense", "A", "R"]
    assert all(c["rel"] < 2e-2 for c in res) and res[1]["same_sets"] >= 0.99


def test_bench_paged_row_holds_one_layout_at_a_time():
    """bench_one times the contiguous kernels, then frees the contiguous K/V while it builds the pools: no
    [batch, s, kv_heads, d] cache is alive while a paged kernel is timed (the 128K batch-64 row needs this). The
    kernels run in interpret mode under a timer that records what is alive (CUPTI needs a GPU)."""
    import jax

    shape = BenchShape(q_heads=4, kv_heads=2, head_dim=64, num_layers=4, num_anchors=2)
    b, s = 2, 96
    seen = []

    def timer(fn, args, iters):
        jax.block_until_ready(fn(*args))
        alive = sum(a.shape == (b, s, 2, 64) for a in jax.live_arrays())
        seen.append((len(args), alive))
        return 1.0 + len(seen) / 10, {}  # the n-th call "takes" 1 + n/10 ms

    row = paged.bench_one(b, s, 16, 0.2, 16, 1, shape, log=lambda *_: None, interpret=True, dense_impl=None,
                          timer=timer, mask="v")
    assert row["paged_mask"] == "v"
    assert [n for n, _ in seen] == [4, 4, 4, 6, 5, 5, 5, 7]  # contiguous dense, A0, A, R; then paged
    assert all(alive >= 2 for _, alive in seen[:4]) and all(alive == 0 for _, alive in seen[4:]), seen
    assert row["A_contig"] == 1.3 and row["A_paged"] == 1.7 and abs(row["A_ratio"] - 1.7 / 1.3) < 1e-12
    assert abs(row["weighted_ratio"] - row["weighted_paged"] / row["weighted_contig"]) < 1e-12


def test_replay_and_report(tmp_path):
    from models.attention import DenseStrategy
    from models.engine import Engine

    model, tok, desc = serve_replay.build_model("random:tiny", 2, "float32")
    trace = serve_replay.make_trace(5, 50.0, 40, 200, 3, 8, model.config.vocab, seed=1)
    assert [t[0] for t in trace] == sorted(t[0] for t in trace) and all(40 <= len(t[1]) <= 200 for t in trace)
    eng = Engine(model, tok, DenseStrategy(), max_batch=2, page_size=16, max_len=256)
    row = serve_replay.replay(eng, trace)
    assert row["requests"] == 5 and row["generated_tokens"] == sum(t[2] for t in trace)
    assert row["tokens_per_s"] > 0 and row["ttft_p99_s"] >= row["ttft_p50_s"] > 0
    assert row["decode_compilations"] == 1 and eng.idle
    chunked = Engine(model, tok, DenseStrategy(), max_batch=2, page_size=16, max_len=256, max_prefill_tokens_per_step=64)
    crow = serve_replay.replay(chunked, trace)  # prefill in 64-token chunks between decode steps: the same tokens
    assert crow["generated_tokens"] == row["generated_tokens"] and crow["decode_compilations"] == 1 and chunked.idle
    meta = dict(gpu="cpu", date="d", jax="j", command="c", model=desc, num_requests=5, arrival_rate=50.0,
                min_prompt=40, max_prompt=200, min_new=3, max_new=8, max_batch=2, page_size=16, num_pages=32, seed=1)
    rows = [dict(strategy="dense", **row), dict(strategy="kascade", **dict(row, tokens_per_s=2 * row["tokens_per_s"]))]
    md = paged_report.update(str(tmp_path), "replay", dict(meta=meta, rows=rows))
    text = open(md).read()
    assert "Continuous-batching replay" in text and "**2.00x**" in text
    # One strategy per command (as a lease needs): a later run of the same trace replaces only its own row ...
    again = dict(meta, date="d2", command="c2")
    paged_report.update(str(tmp_path), "replay", dict(meta=again, rows=[dict(strategy="dense", **dict(
        row, tokens_per_s=row["tokens_per_s"] / 2))]))
    stored = json.loads((tmp_path / "paged.json").read_text())["replay"]
    assert sorted((r["strategy"], r["date"], r["command"]) for r in stored["rows"]) == [("dense", "d2", "c2"),
                                                                                        ("kascade", "d", "c")]
    assert "**4.00x**" in open(md).read()
    # ... and a replay of another trace is refused before it runs (the stored rows untouched)
    before = (tmp_path / "paged.json").read_text()
    with pytest.raises(ValueError, match=r"another trace \(num_requests 5 -> 6\); write to another folder"):
        paged_report.check_replay_target(str(tmp_path), dict(meta, num_requests=6))
    paged_report.check_replay_target(str(tmp_path), dict(meta, command="c3"))  # same trace: fine
    with pytest.raises(ValueError, match=r"another trace"):
        paged_report.update(str(tmp_path), "replay", dict(meta=dict(meta, seed=2), rows=rows))
    assert (tmp_path / "paged.json").read_text() == before
    assert set(json.load(open(tmp_path / "paged.json"))) == {"replay"}
    krow = dict(batch=8, context=32768, page_size=64, topk_frac=0.1)
    for i, n in enumerate(("dense", "A0", "A", "R", "weighted")):
        krow.update({f"{n}_contig": 1.0 + i, f"{n}_paged": 1.1 + i, f"{n}_ratio": (1.1 + i) / (1.0 + i)})
    kmeta = dict(gpu="cpu", date="d", jax="j", command="c", iterations=10, heads="h", page_size="64", formula="f")
    checks = [dict(name="A", rel=1e-3, same_sets=1.0)]
    paged_report.update(str(tmp_path), "kernels", dict(meta=kmeta, checks=checks, rows=[krow]))
    text = open(md).read()
    assert "paged vs contiguous cache" in text and "**1.100**" in text and "Continuous-batching replay" in text
    assert set(json.load(open(tmp_path / "paged.json"))) == {"replay", "kernels"}
    assert (tmp_path / "paged.png").stat().st_size > 1000
    miss = [dict(batch=64, context=131072, page_size=64, reason="failed: JaxRuntimeError: RESOURCE_EXHAUSTED")]
    paged_report.update(str(tmp_path), "kernels", dict(meta=kmeta, checks=checks, rows=[krow], not_measured=miss))
    text = open(md).read()
    assert "Not measured:" in text and "batch 64, context 131072, page 64, mask kv: failed: JaxRuntimeError" in text
    with pytest.raises(ValueError, match="section must be"):
        paged_report.update(str(tmp_path), "other", {})


def _krow(batch, context, page_size, stream_block, base=1.0):
    row = dict(batch=batch, context=context, page_size=page_size, stream_block=stream_block, topk_frac=0.1)
    for i, n in enumerate(("dense", "A0", "A", "R", "weighted")):
        row.update({f"{n}_contig": base + i, f"{n}_paged": base + 0.1 + i, f"{n}_ratio": (base + 0.1 + i) / (base + i)})
    return row


def test_kernels_section_merges_rows_by_shape_and_refuses_an_unreadable_json(tmp_path):
    kmeta = dict(gpu="cpu", date="d", jax="j", command="c", iterations=10, heads="h", page_size="64", formula="f")
    first = [_krow(8, 32768, 64, 128), _krow(8, 32768, 16, 128)]
    miss = [dict(batch=64, context=131072, page_size=64, stream_block=128, reason="failed: OOM")]
    paged_report.update(str(tmp_path), "kernels", dict(meta=kmeta, checks=[], rows=first, not_measured=miss))
    # a second call: re-measures one shape (new numbers), measures the one that failed, adds a stream block
    second = [_krow(8, 32768, 64, 128, base=2.0), _krow(64, 131072, 64, 128), _krow(8, 32768, 64, 256)]
    md = paged_report.update(str(tmp_path), "kernels", dict(meta=kmeta, checks=[], rows=second, not_measured=[]))
    sec = json.load(open(tmp_path / "paged.json"))["kernels"]
    keys = [(r["batch"], r["context"], r["page_size"], r["stream_block"]) for r in sec["rows"]]
    assert sorted(keys) == sorted([(8, 32768, 64, 128), (8, 32768, 16, 128), (64, 131072, 64, 128),
                                   (8, 32768, 64, 256)])
    assert next(r for r in sec["rows"] if r["page_size"] == 64 and r["stream_block"] == 128
                and r["batch"] == 8)["dense_contig"] == 2.0  # the new row replaced the old one of its key
    assert sec["not_measured"] == []
    text = open(md).read()
    assert "| page | stream block | mask |" in text and "| 8 | 32768 | 16 | 128 | kv | 10% |" in text  # no field: kv
    assert "Not measured" not in text
    # the mask A/B (--paged_mask) of a shape already measured sits beside it, never over it; an old row's
    # paged_mask_k=False is "v"
    none, v = dict(_krow(8, 32768, 16, 128, base=3.0), paged_mask="none"), dict(_krow(8, 32768, 16, 128, base=4.0),
                                                                                 paged_mask_k=False)
    paged_report.update(str(tmp_path), "kernels", dict(meta=kmeta, checks=[], not_measured=[], rows=[none, v]))
    sec = json.load(open(tmp_path / "paged.json"))["kernels"]
    same = [r for r in sec["rows"] if (r["batch"], r["page_size"], r["stream_block"]) == (8, 16, 128)]
    assert sorted((store.paged_mask(r), r["dense_contig"]) for r in same) == [("kv", 1.0), ("none", 3.0), ("v", 4.0)]
    assert "| 8 | 32768 | 16 | 128 | none | 10% |" in open(md).read()
    (tmp_path / "paged.json").write_text("{truncated")
    with pytest.raises(ValueError, match=r"paged\.json exists but cannot be read"):
        paged_report.update(str(tmp_path), "replay", dict(meta={}, rows=[]))
    assert (tmp_path / "paged.json").read_text() == "{truncated"


def test_committed_rows_of_paged_mask_k_key_as_kv_and_v():
    """Rows written before DecodeTuning.paged_mask carry paged_mask_k (True: "kv", False: "v"; missing: "kv"): the
    committed session-21 A/B reads as its 4 shapes under "kv" and "v", renders, and a "none" run of one of its shapes
    merges beside them; the committed benchmarks/paged.json (measured before any masked load, marked "none") renders
    as such."""
    root = Path(__file__).resolve().parents[2]
    sec = json.load(open(root / "results/accuracy/h200_2026-12-04_i21s21/paged5/paged.json"))["kernels"]
    shapes = {(b, s, 64, 128) for b in (8, 64) for s in (32768, 131072)}
    assert sorted(store._paged_key(r) for r in sec["rows"]) == sorted(x + (m,) for x in shapes for m in ("kv", "v"))
    text = tables.paged_markdown(dict(kernels=sec))
    assert "| 8 | 32768 | 64 | 128 | kv | 10% |" in text and "| 8 | 32768 | 64 | 128 | v | 10% |" in text
    new = dict(sec["rows"][0], paged_mask="none")
    merged = store.merge_paged_kernels(sec, dict(sec, rows=[new], not_measured=[]))
    assert len(merged["rows"]) == 9 and sum(store.paged_mask(r) == "none" for r in merged["rows"]) == 1
    bench = json.load(open(root / "benchmarks/paged.json"))
    assert "| 8 | 32768 | 64 | 128 | none |" in tables.paged_markdown(bench)


def test_bench_paged_int_flags_name_the_flag():
    assert bench_paged.int_list("paged_contexts", ["32768", "131072"]) == [32768, 131072]
    with pytest.raises(ValueError, match=r"--paged_batches takes comma-separated integers, got '8k'"):
        bench_paged.int_list("paged_batches", ["8k"])


def test_replay_counts_a_request_whose_prefill_failed(rng):
    """A request whose prefill raises never produces a token: the replay finishes, counts it in failed_requests
    with its error, and reports the other requests' metrics (it used to die with an IndexError)."""
    import dataclasses

    from models.attention import DenseStrategy
    from models.engine import Engine

    @dataclasses.dataclass(frozen=True)
    class RefusesLongPrefill(DenseStrategy):
        name: str = "dense_refusing_long_prefill"

        def attend(self, layer, inputs, state):
            if inputs.phase == "prefill" and inputs.q.shape[1] > 64:
                raise ValueError("this strategy refuses prefills wider than 64 tokens")
            return super().attend(layer, inputs, state)

    model, tok, _ = serve_replay.build_model("random:tiny", 2, "float32")
    # arrivals 0, 0.01, 0.02 s: short, long (its padded prefill is 128 wide: fails), short
    trace = [(0.01 * i, rng.integers(0, model.config.vocab, n).tolist(), 4) for i, n in enumerate((40, 100, 50))]
    eng = Engine(model, tok, RefusesLongPrefill(), max_batch=2, page_size=16, max_len=256)
    logs = []
    row = serve_replay.replay(eng, trace, log=logs.append)
    assert row["requests"] == 3 and row["failed_requests"] == 1 and row["generated_tokens"] == 8
    assert "refuses prefills wider than 64" in row["first_error"] and logs and eng.idle
    assert row["tokens_per_s"] > 0 and row["ttft_p50_s"] > 0


def test_replay_kascade_on_a_real_alias_uses_its_recipe_at_bfloat16():
    """--model=smollm2-135m (the flag of every entry point): the kascade strategy carries the shipped recipe's levers
    and the anchors and head map of the shipped (float32) calibration, found although the replay runs in bfloat16
    (no calibration); without --model the front end replays its random Llama-3.1-8B-shape model. A subprocess: the
    front end shares experiments.common's flags, which experiments.eval defines differently (forked: tests/cli_fork.py)."""
    from kascade_jax.calibration.artifact import CalibrationArtifact
    from kascade_jax.calibration.resolve import PACKAGED_DIR

    script = """
import json, sys
from absl import flags
from experiments import serve_replay as sr
from models import load_model
flags.FLAGS(["serve_replay"])
default = sr.model_spec()
flags.FLAGS.unparse_flags()
flags.FLAGS(["serve_replay", "--model=smollm2-135m", "--dtype=bfloat16"])
model, tok = load_model("smollm2-135m", "bfloat16")
c = sr.build_strategy("kascade", model, tok, sr.model_spec()).config
print(json.dumps([default, sr.model_spec(), list(c.anchors), [list(r) for r in c.head_map],
                  [c.sink_tokens, c.recent_window, c.dense_suffix]]))
"""
    res = cli_fork.run(["-c", script], cli_fork.ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    default, spec, anchors, head_map, levers = json.loads(res.stdout.splitlines()[-1])
    assert default == "random:llama3-8b" and spec == "smollm2-135m"
    art = CalibrationArtifact.load(PACKAGED_DIR / "smollm2-135m-builtin-64-k64-ts32.json")
    assert tuple(anchors) == (0, 2, 8, 18, 21, 24)  # the shipped default pins them (smol_p6_dec30, session 19)
    assert np.array_equal(np.asarray(head_map), art.head_map(tuple(anchors)))
    assert levers == [4, 60, 0]


def test_replay_with_its_gpu_defaults_is_refused_on_a_cpu():
    """The default replay (8 layers of the 8B shape, 16K prompts) would need ~20 GB of host memory: refused by
    name before any model is built; the tiny shape stays allowed."""
    res = cli_fork.run(["-m", "experiments.serve_replay"], cli_fork.ENV)
    assert res.returncode != 0 and "serve_replay on a CPU" in res.stderr and "about 20 GB" in res.stderr, res.stderr
    assert serve_replay.random_model_gb("tiny", 2, "float32", 100, 16) < 0.01


def test_replay_refuses_its_bad_flags_before_any_replay():
    """Issue 24's probes of serve_replay, each refused in one line before any model is built: anchors past a random
    model's --replay_layers (was: after the whole dense replay), a --dense_suffix that covers the shortest prompt (was:
    silent), an unknown strategy under the shared --strategies; the old --replay_strategies spelling still works."""
    tiny = ["-m", "experiments.serve_replay", "--model=random:tiny", "--num_requests=1", "--min_prompt=64",
            "--max_prompt=64", "--min_new=1", "--max_new=1"]
    for extra, want in ((["--replay_layers=2", "--anchors=0,5"], "anchor"),
                        (["--strategies=dense,quest"], "--strategies takes dense and kascade"),
                        (["--replay_strategies=dense,quest"], "--strategies takes dense and kascade")):
        res = cli_fork.run(tiny + extra, cli_fork.ENV)
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert res.returncode != 0 and len(lines) == 1 and want in lines[0], (extra, res.stderr[-2000:])
        assert "requests over" not in res.stdout, res.stdout  # the header prints once the model is built
    res = cli_fork.run(["-m", "experiments.serve_replay", "--model=smollm2-135m", "--dense_suffix=100000",
                        "--min_prompt=64", "--max_prompt=128", "--strategies=dense,kascade"], cli_fork.ENV)
    assert res.returncode != 0 and "--dense_suffix" in res.stderr and "covers the whole prompt" in res.stderr, \
        res.stderr[-2000:]
    assert "requests over" not in res.stdout


def test_replay_builds_no_program_after_its_warm_up():
    """The replay's compile count (issue 23: a compilation inside the timed replay stalls every running request;
    at the 8B shape one costs tens of seconds). After `warm_up` the replay builds no XLA program: not with chunked
    prefill over several prompt buckets (chunks at 0 and after it), and not when more than 8 slots cross a page
    boundary in one decode step (`zero_pages` pads 9-16 new pages to 16: the warm-up's one-request buckets never
    ran that size)."""
    from models.attention import DenseStrategy
    from models.engine import Engine

    model, tok, _ = serve_replay.build_model("random:tiny", 2, "float32")
    vocab = model.config.vocab
    chunked = Engine(model, tok, DenseStrategy(), max_batch=4, page_size=64, max_len=1088,
                     max_prefill_tokens_per_step=256)  # the planned H200 run scaled down: 2-4 chunks a prompt
    with serve_replay.Compiles() as c:
        serve_replay.warm_up(chunked, 512, 1024, vocab, compiles=c)
        trace = serve_replay.make_trace(6, 200.0, 512, 1024, 2, 6, vocab, seed=2)
        row = serve_replay.replay(chunked, trace, compiles=c, progress_s=None)
    assert row["replay_compilations"] == 0 and c.count("replay") == 0, c.events
    assert row["generated_tokens"] == sum(t[2] for t in trace) and c.count("warm-up") <= 20
    # 12 requests of one length, admitted together: their decode crosses each page boundary in the same step
    wide = Engine(model, tok, DenseStrategy(), max_batch=16, page_size=16, max_len=128)
    with serve_replay.Compiles() as c:
        serve_replay.warm_up(wide, 40, 40, vocab, compiles=c)
        row = serve_replay.replay(wide, [(0.0, list(range(40)), 30)] * 12, compiles=c, progress_s=None)
    assert row["replay_compilations"] == 0, [e for e in c.events if e[2] == "replay"]
    assert row["generated_tokens"] == 12 * 30


def test_compiles_counts_programs_by_phase_until_exit():
    import jax

    with serve_replay.Compiles() as c:
        c.phase = "a"
        jax.jit(lambda x: x * 3 + 1)(np.ones(5))
        c.phase = "b"
        jax.jit(lambda x: x * 5 - 2)(np.ones(6))
        assert c.compiling() is None
    jax.jit(lambda x: x * 7)(np.ones(7))  # after exit: not counted
    assert c.count("a") == 1 and c.count("b") == 1 and c.count() == 2 and c.seconds() > 0
    assert all("lambda" in name for name, _, _ in c.events)


def test_replay_logs_progress_and_stops_at_its_deadline():
    """A replay that would run 10 s stops at its deadline (1 s) at a step boundary: the row says what was left,
    its metrics cover what was generated; progress lines came on the way."""
    import time

    from models.attention import DenseStrategy
    from models.engine import Engine

    model, tok, _ = serve_replay.build_model("random:tiny", 1, "float32")
    eng = Engine(model, tok, DenseStrategy(), max_batch=2, page_size=16, max_len=256)
    serve_replay.warm_up(eng, 40, 80, model.config.vocab)
    trace = [(0.05 * i, list(range(40 + i % 40)), 4) for i in range(200)]
    logs = []
    t = time.perf_counter()
    row = serve_replay.replay(eng, trace, log=logs.append, progress_s=0.2, deadline=t + 1.0)
    assert time.perf_counter() - t < 5
    assert "not yet arrived" in row["stopped"] and row["requests"] < 200 and row["generated_tokens"] > 0
    assert row["failed_requests"] == 0 and row["tokens_per_s"] > 0
    assert any(line.startswith("  replay ") and "arrived" in line and "decode steps" in line for line in logs), logs
    meta = dict(gpu="cpu", date="d", jax="j", command="c", model="m", num_requests=200, arrival_rate=20.0,
                min_prompt=40, max_prompt=80, min_new=4, max_new=4, max_batch=2, page_size=16, num_pages=32, seed=0)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        text = open(paged_report.update(d, "replay", dict(meta=meta, rows=[dict(strategy="dense", **row)]))).read()
    assert "Stopped by the time limit" in text and "not yet arrived" in text


def test_watchdog_reports_a_quiet_main_thread_and_ends_it_past_the_hard_deadline():
    import time

    lines, exits = [], []
    with serve_replay.Watchdog(lambda: "compiling jit(f) for 9 s", 0.2, log=lines.append):
        time.sleep(0.7)  # the main thread inside one long call: the log is quiet
    assert len(lines) >= 2 and all("[watchdog] compiling jit(f)" in x for x in lines), lines
    n = len(lines)
    time.sleep(0.3)
    assert len(lines) == n  # stopped with its context
    with serve_replay.Watchdog(lambda: "stuck", 0.2, hard_deadline=time.perf_counter() + 0.3, log=lines.append,
                               exit=exits.append):
        time.sleep(0.8)
    assert exits == [3] and "TIME LIMIT" in lines[-1] and "stuck" in lines[-1]


def test_serve_replay_time_limit_stops_writes_and_exits_3():
    """--replay_time_limit: the command stops at the limit (in the warm-up or the timed replay, whichever it
    reaches on this machine), says so, skips the strategies after it and exits with status 3."""
    res = cli_fork.run(["-m", "experiments.serve_replay", "--model=random:tiny", "--replay_layers=1",
                        "--num_requests=100", "--arrival_rate=10", "--min_prompt=64", "--max_prompt=128",
                        "--min_new=2", "--max_new=4", "--replay_time_limit=3", "--replay_progress_s=1"], cli_fork.ENV)
    assert res.returncode == 3, res.stderr[-2000:]
    assert "STOPPED by --replay_time_limit: dense:" in res.stdout and "not run: kascade" in res.stdout, res.stdout


def test_serve_replay_fp8_lever_on_a_random_model(tmp_path):
    """--decode_score_fp8 on a random model: the Kascade engine carries the fp8 K copy (its page pools and per-slot
    scale) through a whole replay, its row is named kascade_fp8d (beside kascade's in paged.json), and paged.md
    gives each non-dense row's ratio to dense."""
    from kascade_jax.config import KascadeConfig
    from kascade_jax.strategies import KascadeStrategy

    res = cli_fork.run(["-m", "experiments.serve_replay", "--model=random:tiny", "--replay_layers=3", "--anchors=0,1",
                        "--num_requests=3", "--arrival_rate=50", "--min_prompt=64", "--max_prompt=128",
                        "--min_new=2", "--max_new=4", "--strategies=kascade", "--decode_score_fp8"],
                       cli_fork.ENV, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "kascade_fp8d: " in res.stdout and "generated tok/s" in res.stdout, res.stdout[-2000:]
    cfg = dict(num_layers=3, kv_heads=1, anchors=(0, 1))
    label = serve_replay.row_label
    assert label("kascade", KascadeStrategy(KascadeConfig(**cfg))) == "kascade"
    assert label("kascade", KascadeStrategy(KascadeConfig(**cfg, decode_score_fp8=True))) == "kascade_fp8d"
    row = dict(requests=3, generated_tokens=9, tokens_per_s=10.0, makespan_s=1.0, ttft_p50_s=0.1, ttft_p99_s=0.2,
               tpot_p50_ms=5.0, tpot_p99_ms=6.0, decode_steps=4, mean_active=1.5)
    meta = dict(gpu="cpu", date="d", jax="j", command="c", model="m", num_requests=3, arrival_rate=50.0,
                min_prompt=64, max_prompt=128, min_new=2, max_new=4, max_batch=8, page_size=64, num_pages=32, seed=0)
    rows = [dict(row, strategy="dense"), dict(row, strategy="kascade", tokens_per_s=20.0),
            dict(row, strategy="kascade_fp8d", tokens_per_s=25.0)]
    text = open(paged_report.update(str(tmp_path), "replay", dict(meta=meta, rows=rows))).read()
    assert "kascade / dense generated tokens/s: **2.00x**" in text
    assert "kascade_fp8d / dense generated tokens/s: **2.50x**" in text
