import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if os.environ.get("KASCADE_TEST_JAX_CACHE"):
    # launch.sh test: one persistent compile cache for the run, shared by both workers and the CLIs their tests
    # start (set before jax is imported); entries are renamed into place (tests/jax_cache.py).
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["KASCADE_TEST_JAX_CACHE"]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    from tests import jax_cache

    jax_cache.install()


# The files with the longest tests (a fresh clone's --durations on the 2-core box, 2026-12-03), handed to the two
# xdist workers first: `--dist loadfile` gives out whole files in collection order, and these came last (models/,
# the notebook). The gain is within the box's drift so far (docs/testing.md).
SLOW_FILES = ("tests/models/test_sharding.py", "tests/test_notebook.py", "tests/kascade_jax/test_eval.py",
              "tests/experiments/test_cli.py", "tests/experiments/test_bench_e2e.py", "tests/models/test_parity.py",
              "tests/experiments/test_serve_replay.py")


def pytest_collection_modifyitems(config, items):
    rank = {f: i for i, f in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(SLOW_FILES)))  # stable: file order kept


@pytest.fixture
def rng(request):
    """A numpy Generator per test, seeded from the test's id, so CI draws the same inputs on every run (a random
    seed once failed CI on a draw no other run saw). KASCADE_TEST_SEED=<int> replays a printed seed,
    KASCADE_TEST_SEED=random draws a fresh one per test (to look for inputs that break a test)."""
    choice = os.environ.get("KASCADE_TEST_SEED", "")
    if choice == "random":
        seed = int.from_bytes(os.urandom(4), "little")
    elif choice:
        seed = int(choice)
    else:
        seed = zlib.crc32(request.node.nodeid.encode())
    print(f"[seed] {request.node.nodeid}: {seed}")
    return np.random.default_rng(seed)


def tiny_config(model_type="llama", **over):
    from models.config import ModelConfig

    cfg = dict(model_type=model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
               rms_norm_eps=1e-5, rope_theta=10000.0)
    cfg.update(over)
    return ModelConfig.from_hf(cfg)


class CharTokenizer:
    """A tokenizer for tiny random models: one id per character (ids 5..104), no EOS; decode gives letters."""

    eos_token_ids = ()

    def encode(self, text):
        return [5 + (ord(c) % 100) for c in text]

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def run_on_8_simulated_devices(test_file: str, select: str, timeout: int):
    """Run `pytest -k select` over test_file in a subprocess whose JAX has 8 simulated CPU devices (the flag must be
    set before jax is imported, so not in this process). Returns (CompletedProcess, the tail of its output)."""
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "-rs",
                          "-k", select, os.path.abspath(test_file)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return res, res.stdout[-6000:] + res.stderr[-2000:]


@pytest.fixture(scope="session")
def tiny_model():
    from models.params import random_model

    return random_model(tiny_config(), seed=7)


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (SmolLM2-135M-Instruct Q4_1 GGUF, dequantised to f32) and its tokenizer."""
    from models import load_model

    return load_model("smollm2-135m", "float32")


@pytest.fixture
def triton_sm90_modules(monkeypatch):
    """Lowering Pallas kernels for CUDA on the CPU, with every Triton module verified: returns the list that gets one
    entry per verified module (its text). Catches GPU-only lowering errors without a GPU. Uses JAX-internal hooks."""
    reg = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="sm_90", compute_capability=90))
    lower_module = reg.lowering.lower_jaxpr_to_triton_module
    verified = []

    def checked(*args, **kwargs):
        res = lower_module(*args, **kwargs)
        assert res.module.operation.verify()
        verified.append(str(res.module))  # the module's text (TTIR), for tests that look inside
        return res

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", checked)
    return verified
