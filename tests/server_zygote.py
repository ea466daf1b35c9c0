"""`python -m servelm.cli ...` for the tests, forked from a process that imported servelm's
CLI and server once, instead of a fresh interpreter importing torch, servelm, FastAPI and
uvicorn at every server start (seconds each, a dozen servers a run).

`launch(args, log, cwd, env)` returns a Popen-like handle (pid, poll, wait, send_signal,
terminate, kill, returncode). The zygote is a child of this process, started on first use;
it reads one JSON request a line on stdin and answers one JSON line on stdout. Its children
run `servelm.cli.main()` as `python -m servelm.cli` runs it: `__main__` is servelm.cli,
sys.argv[0] its file, sys.path[0] the working directory, the environment and working
directory the caller's, stdin /dev/null, stdout and stderr the log; atexit handlers run at
the end, and the exit status is the caller's to read (a signal's death: -signal)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

# ---- the zygote (this file run as a program) ---------------------------------------------------


def _preload() -> None:
    """What every `serve` imports (its engine's build too: the GGUF reader, the kernels'
    loader); nothing runs (no torch op, no thread, no kernel loaded)."""
    import gguf  # noqa: F401
    import torch.utils.cpp_extension  # noqa: F401
    import uvicorn  # noqa: F401

    import servelm.cli  # noqa: F401
    import servelm.models.decoder  # noqa: F401
    import servelm.server.api  # noqa: F401
    import servelm.server.launcher  # noqa: F401
    import servelm.server.transport  # noqa: F401
    import servelm.tuning

    # The suite's other worker keeps the CPUs busy: a server's table measured beside it is
    # cached as measured, as the in-process engines' are (conftest's _steady_kernel_timings).
    servelm.tuning._busy_reason = lambda window: None


def _run_child(req: dict) -> None:
    """In the forked child: become `python -m servelm.cli *argv`, or `python SCRIPT *argv`
    where the request names a script; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(req["log"], os.O_WRONLY | os.O_APPEND)
        err = os.open(req.get("err") or req["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {null, out, err}:
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        try:
            if req.get("script"):
                import runpy

                script = req["script"]
                sys.argv = [script, *req["argv"]]
                sys.path[0] = os.path.dirname(os.path.abspath(script))
                runpy.run_path(script, run_name="__main__")
                code = 0
            else:
                import servelm.cli as cli

                sys.modules["__main__"] = cli
                sys.argv = [cli.__file__, *req["argv"]]
                sys.path[0] = req["cwd"]
                code = cli.main()
        except SystemExit as e:
            code = e.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve() -> None:
    _preload()
    pipe_in, pipe_out = sys.stdin, sys.stdout
    exited: dict[int, int] = {}

    def reap(pid: int, block: bool) -> int | None:
        if pid not in exited:
            done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            if done:
                exited[pid] = os.waitstatus_to_exitcode(status)
        return exited.get(pid)

    for line in pipe_in:
        req = json.loads(line)
        if req["op"] == "start":
            pid = os.fork()
            if pid == 0:
                _run_child(req)
            reply = {"pid": pid}
        elif req["op"] == "wait":  # timeout None: until it exits; else poll until then
            pid, timeout = req["pid"], req["timeout"]
            code = reap(pid, block=timeout is None)
            if timeout is not None:
                deadline = time.monotonic() + timeout
                while code is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                    code = reap(pid, block=False)
            reply = {"code": code}
        else:
            reply = {"error": f"unknown op {req['op']!r}"}
        pipe_out.write(json.dumps(reply) + "\n")
        pipe_out.flush()


# ---- the test process's side ---------------------------------------------------------------

_zygote: subprocess.Popen | None = None
_lock = threading.Lock()


def _ask(req: dict) -> dict:
    global _zygote
    with _lock:
        if _zygote is None or _zygote.poll() is not None:
            _zygote = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, bufsize=1)
        _zygote.stdin.write(json.dumps(req) + "\n")
        _zygote.stdin.flush()
        line = _zygote.stdout.readline()
    if not line:
        raise RuntimeError("the server zygote died")
    reply = json.loads(line)
    if "error" in reply:
        raise RuntimeError(reply["error"])
    return reply


class ZygoteProcess:
    """The Popen methods the tests use, for a process the zygote forked."""

    def __init__(self, args: list[str], log: str, cwd: str, env: dict[str, str],
                 script: str | None = None, err: str | None = None):
        self.args = args
        self.returncode: int | None = None
        self.pid = _ask({"op": "start", "argv": list(args), "log": log, "cwd": cwd,
                         "env": dict(env), "script": script, "err": err})["pid"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _ask({"op": "wait", "pid": self.pid, "timeout": 0})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = _ask({"op": "wait", "pid": self.pid, "timeout": timeout})["code"]
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def launch(args: list[str], log: str, cwd: str,
           env: dict[str, str] | None = None) -> ZygoteProcess | subprocess.Popen:
    """`python -m servelm.cli *args`, stdout and stderr appended to the file `log`."""
    env = dict(os.environ if env is None else env)
    if not hasattr(os, "fork"):
        with open(log, "a") as f:
            return subprocess.Popen([sys.executable, "-m", "servelm.cli", *args], stdout=f,
                                    stderr=subprocess.STDOUT, cwd=cwd, env=env)
    return ZygoteProcess(args, log, cwd, env)


def run_script(script: str, *args: str, cwd: str,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
    cwd=cwd, timeout=timeout), the script run by a process the zygote forked."""
    import tempfile

    with tempfile.NamedTemporaryFile("w+") as out, tempfile.NamedTemporaryFile("w+") as err:
        proc = ZygoteProcess(list(args), out.name, cwd, dict(os.environ), script=str(script),
                             err=err.name)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess([sys.executable, str(script), *args], code,
                                           out.read(), err.read())


if __name__ == "__main__":
    _serve()
