"""GPU facts: a shipped table (gpus.yaml, every value sourced from a vendor datasheet) and
the GPU a machine actually has, as `nvidia-smi` names it."""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from treetune.errors import ConfigFileError, TreetuneError
from treetune.yamlio import load_yaml

NVIDIA_SMI_QUERY = ["--query-gpu=name,memory.total", "--format=csv,noheader"]
NVIDIA_SMI_TIMEOUT_S = 30.0
OVERRIDE = "--gpu NAME (backend.gpu in a study file)"


@dataclass(frozen=True)
class GpuFacts:
    name: str  # the table's key, as profiles name it (hardware.gpu)
    names: tuple[str, ...]  # how nvidia-smi and users name it
    memory_gb: float
    bandwidth_tb_s: float
    bf16_tflops: float
    fp8_tflops: float | None  # None: no FP8 tensor cores
    interconnect_gb_s: float  # per GPU and direction

    def peak_tflops(self, weight_bytes: float) -> float:
        """Dense peak at the weights' precision: FP8 tensor cores for 8-bit weights where
        the GPU has them; 16-bit math otherwise (4-bit weights are dequantized to BF16)."""
        if weight_bytes == 1.0 and self.fp8_tflops is not None:
            return self.fp8_tflops
        return self.bf16_tflops


@dataclass(frozen=True)
class SeenGpu:
    """One GPU as nvidia-smi reports it."""

    name: str
    memory_mib: float | None


def _key(name: str) -> str:
    """A name as matched: no case, no punctuation, no vendor prefix."""
    text = re.sub(r"^(nvidia|amd)\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]", "", text)


def table_path() -> Path:
    return Path(str(resources.files("treetune") / "facts" / "gpus.yaml"))


@functools.cache
def gpu_table() -> dict[str, GpuFacts]:
    path = table_path()
    data = load_yaml(path)
    table = {}
    for name, entry in data.items():
        try:
            table[name] = GpuFacts(name=name, names=tuple(entry.pop("names", ())), **entry)
        except TypeError as exc:
            raise ConfigFileError(path, str(exc), str(name)) from None
    return table


def gpu_facts(name: str, source: str = "--gpu") -> GpuFacts:
    """The table's entry for `name` (a table key, an nvidia-smi name or a unique prefix of
    one); `source` says where the name came from, for the error."""
    table = gpu_table()
    wanted = _key(name)
    spellings = {g.name: {_key(g.name), *map(_key, g.names)} for g in table.values()}
    exact = [n for n, keys in spellings.items() if wanted in keys]
    if len(exact) == 1:
        return table[exact[0]]
    prefixed = [n for n, keys in spellings.items() if wanted and any(
        k.startswith(wanted) for k in keys)]
    if len(prefixed) == 1:
        return table[prefixed[0]]
    if len(prefixed) > 1:
        raise TreetuneError(f"GPU '{name}' ({source}) could be {', '.join(prefixed)}: name "
                            f"one with {OVERRIDE}")
    raise TreetuneError(
        f"GPU '{name}' ({source}) is not in treetune's GPU table: name a GPU it knows with "
        f"{OVERRIDE}, one of {', '.join(table)} (or write the profile by hand and give it "
        "with --prior)")


def query_gpus(env: Mapping[str, str] | None = None) -> list[SeenGpu]:
    """The GPUs this process may use, from `nvidia-smi` (no shell). nvidia-smi lists every
    GPU of the node whatever CUDA_VISIBLE_DEVICES says, so the devices a Ray worker was
    given are passed to it with --id."""
    env = dict(os.environ if env is None else env)
    where = socket.gethostname()
    program = shutil.which("nvidia-smi", path=env.get("PATH"))
    if program is None:
        raise TreetuneError(f"nvidia-smi was not found on {where} (PATH): name the GPU with "
                            f"{OVERRIDE}")
    argv = [program, *NVIDIA_SMI_QUERY]
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible and visible != "NoDevFiles":
        argv.append(f"--id={visible}")
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              env=env, timeout=NVIDIA_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise TreetuneError(f"nvidia-smi on {where} did not answer within "
                            f"{NVIDIA_SMI_TIMEOUT_S:.0f} s: name the GPU with {OVERRIDE}"
                            ) from None
    except OSError as exc:
        raise TreetuneError(f"cannot run nvidia-smi on {where}: {exc.strerror}: name the GPU "
                            f"with {OVERRIDE}") from None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        said = [line.strip() for line in (done.stderr or done.stdout).splitlines()
                if line.strip()]
        cause = said[-1] if said else f"exit code {done.returncode}, no GPU listed"
        raise TreetuneError(f"nvidia-smi on {where} lists no GPU ({cause}): name the GPU "
                            f"with {OVERRIDE}")
    return [_parse(line) for line in lines]


def _parse(line: str) -> SeenGpu:
    name, _, memory = line.rpartition(",") if "," in line else (line, "", "")
    number = re.match(r"\s*([\d.]+)", memory)
    return SeenGpu(name.strip(), float(number.group(1)) if number else None)


def detect_gpu(env: Mapping[str, str] | None = None) -> GpuFacts:
    """The table's entry for the GPU this process sees (every visible GPU must be the
    same model: a server's tensor-parallel group runs at its slowest GPU's pace)."""
    seen = query_gpus(env)
    names = sorted({g.name for g in seen})
    if len(names) > 1:
        raise TreetuneError(f"the GPUs on {socket.gethostname()} differ ({', '.join(names)}):"
                            f" name the one to model with {OVERRIDE}")
    memory = f", {seen[0].memory_mib:.0f} MiB" if seen[0].memory_mib else ""
    return gpu_facts(names[0], f"nvidia-smi on {socket.gethostname()}{memory}")
