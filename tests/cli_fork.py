"""Run `python -m experiments.X ...` / `python -c SCRIPT ...` as real child processes, forked from a server that has
imported jax, flax and kascade_jax once: each probe then costs a fork and the entry point's own imports, not ~3 s of
library imports (the CLI probes of test_errors.py and test_cli.py start about 80 of them).

A child is a fresh process as far as the entry point can tell: its own exit status, stdout and stderr (files), cwd,
environment and absl flags (the server imports no module that defines a flag). What it cannot show is output the
pre-imported libraries print while importing: the server reports its own import output and `run` refuses to go on if
there was any, so a warning at import time still fails the probes. Start the server with the environment the probes
use (jax reads its JAX_* settings when imported); a request's XLA_FLAGS still applies (read when the backend starts).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The environment of most probes: a test that passes this one shares the server of its worker with the others.
ENV = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
PRELOAD = ("numpy", "jax", "jax.numpy", "flax.nnx", "absl.app", "absl.flags", "kascade_jax.registry",
           "kascade_jax.recipes", "kascade_jax.calibration.runner")


def _child(req):
    """In the forked child: what `python ARGS` would do, with fds 1 and 2 on the request's files."""
    import runpy

    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    args, code = req["args"], 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]  # run_module puts the module's file in argv[0], as `python -m` does
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            raise ValueError(f"cli_fork runs -m MODULE or -c SCRIPT, got {args[:1]}")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  (what the interpreter does with an uncaught exception)
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve():
    """The server loop: one JSON request a line on stdin; replies `pid` then `rc` lines on the original stdout."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    sys.path[0] = str(ROOT)  # as `python -m` from the repo root (not tests/, whose models/ would shadow the package)
    import importlib

    with tempfile.TemporaryFile("w+") as log:  # what the imports print, handed to the client
        saved = os.dup(2), os.dup(1)
        os.dup2(log.fileno(), 2)
        os.dup2(log.fileno(), 1)
        try:
            for name in PRELOAD:
                importlib.import_module(name)
            if os.environ.get("KASCADE_TEST_JAX_CACHE"):  # the run's shared compile cache: atomic writes
                importlib.import_module("tests.jax_cache").install()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 2)
            os.dup2(saved[1], 1)
        log.seek(0)
        threads = len(os.listdir("/proc/self/task"))  # forking a threaded process risks a deadlocked child
        reply.write(json.dumps({"import_output": log.read(), "threads": threads}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            reply.close()
            _child(req)
        reply.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


_servers: dict = {}
_lock = threading.Lock()


def run(args, env, cwd=ROOT, timeout=120) -> subprocess.CompletedProcess:
    """Like subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True), forked from
    a server started with `env` less XLA_FLAGS; one probe at a time per server."""
    key = tuple(sorted((k, v) for k, v in env.items() if k != "XLA_FLAGS"))
    with _lock:
        server = _servers.get(key)
        if server is None or server.poll() is not None:
            # one BLAS thread in the server: numpy's OpenBLAS pool would be the one thread a fork leaves behind (the
            # children get the request's environment)
            server = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=ROOT,
                                      env=dict(key, OPENBLAS_NUM_THREADS="1"),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            hello = json.loads(server.stdout.readline())
            assert hello["import_output"] == "", f"importing {PRELOAD} printed:\n{hello['import_output'][-2000:]}"
            assert hello["threads"] == 1, f"the cli_fork server has {hello['threads']} threads after its imports"
            _servers[key] = server
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            server.stdin.write(json.dumps(dict(args=list(map(str, args)), env=env, cwd=str(cwd), out=out,
                                               err=err)) + "\n")
            server.stdin.flush()
            pid = json.loads(server.stdout.readline())["pid"]
            timer = threading.Timer(timeout, os.kill, (pid, signal.SIGKILL))
            timer.start()
            try:
                rc = json.loads(server.stdout.readline())["rc"]
            finally:
                timer.cancel()
            if rc == -signal.SIGKILL:
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
            return subprocess.CompletedProcess([sys.executable, *args], rc, Path(out).read_text(errors="replace"),
                                               Path(err).read_text(errors="replace"))


if __name__ == "__main__":
    serve()
