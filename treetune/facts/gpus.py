"""GPU facts: a shipped table (gpus.yaml, every value sourced from a vendor datasheet) and
the GPU a machine actually has, as `nvidia-smi` (or `amd-smi`, `rocm-smi`) names it."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from treetune.errors import ConfigFileError, TreetuneError, clip
from treetune.yamlio import load_yaml

NVIDIA_SMI_QUERY = ["--query-gpu=name,memory.total", "--format=csv,noheader"]
AMD_SMI_QUERY = ["static", "--asic", "--vram", "--json"]
ROCM_SMI_QUERY = ["--showproductname", "--showmeminfo", "vram", "--json"]
SMI_TIMEOUT_S = 30.0
OVERRIDE = "--gpu NAME (backend.gpu in a study file)"


# The table's Blackwell GPUs (compute capability 10), on which SGLang picks other defaults.
BLACKWELL_GPUS = ("B200", "B300", "GB200")


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
    """One GPU as the node's management tool reports it."""

    name: str
    memory_mib: float | None
    tool: str = "nvidia-smi"


def _words(name: str) -> tuple[str, ...]:
    """A name's words as matched: no case, no punctuation, no vendor or product-line prefix
    (AMD's tools print "AMD Instinct MI300X OAM" where users write "MI300X OAM")."""
    text = re.sub(r"^(nvidia|amd)\s+(instinct\s+)?", "", name.strip().lower())
    return tuple(re.findall(r"[a-z0-9]+", text))


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
    """The table's entry for `name` (a table key, an nvidia-smi name, or the first whole
    words of one: "H100 NVL", not "L40" for the L40S nor "A10" for an A100, which are other
    GPUs); `source` says where the name came from, for the error."""
    table = gpu_table()
    words = _words(name)
    wanted = "".join(words)  # spaces and dashes aside: "H100-SXM" is "H100 SXM"
    spellings = {g.name: {_words(g.name), *map(_words, g.names)} for g in table.values()}
    exact = [n for n, spelled in spellings.items() if wanted in {"".join(w) for w in spelled}]
    if len(exact) == 1:
        return table[exact[0]]
    prefixed = [n for n, spelled in spellings.items() if words and any(
        w[:len(words)] == words for w in spelled)]
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
    """The GPUs this process may use, from the node's management tool (no shell):
    `nvidia-smi` on NVIDIA nodes, else `amd-smi` or the older `rocm-smi` on AMD nodes.
    These tools list every GPU of the node whatever the *_VISIBLE_DEVICES variables say, so
    only the devices a Ray worker was given are kept."""
    env = dict(os.environ if env is None else env)
    for tool in SMI_TOOLS:
        program = shutil.which(tool.program, path=env.get("PATH"))
        if program is not None:
            return tool.query(program, env)
    names = ", ".join(t.program for t in SMI_TOOLS)
    raise TreetuneError(f"no GPU management tool ({names}) was found on "
                        f"{socket.gethostname()} (PATH): name the GPU with {OVERRIDE}")


def _visible(env: Mapping[str, str], variables: tuple[str, ...]) -> str | None:
    """The device list the first set variable gives (as a Ray worker sees it), or None."""
    for variable in variables:
        value = env.get(variable, "").strip()
        if value and value != "NoDevFiles":
            return value
    return None


def _run(program: str, argv: list[str], env: Mapping[str, str]) -> str:
    """`program`'s standard output; a one-line TreetuneError naming the override when it
    cannot run, fails or lists nothing."""
    tool, where = Path(program).name, socket.gethostname()
    try:
        # Its own session: a tool that hangs is ended with whatever it started.
        proc = subprocess.Popen([program, *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace", env=dict(env), start_new_session=True)
    except OSError as exc:
        raise TreetuneError(f"cannot run {tool} on {where}: {exc.strerror}: name the GPU "
                            f"with {OVERRIDE}") from None
    try:
        stdout, stderr = proc.communicate(timeout=SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # a child that left the group
            proc.communicate(timeout=5)
        raise TreetuneError(f"{tool} on {where} did not answer within {SMI_TIMEOUT_S:.0f} s:"
                            f" name the GPU with {OVERRIDE}") from None
    if proc.returncode != 0:
        raise _lists_no_gpu(tool, stderr or stdout, "no output",
                            f"exit code {proc.returncode}: ")
    if not stdout.strip():
        raise _lists_no_gpu(tool, stderr, "exit code 0, no GPU listed")
    return stdout


def _lists_no_gpu(tool: str, said: str, otherwise: str, prefix: str = "") -> TreetuneError:
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    cause = prefix + (clip(lines[-1], 200) if lines else otherwise)
    return TreetuneError(f"{tool} on {socket.gethostname()} lists no GPU ({cause}): name the"
                         f" GPU with {OVERRIDE}")


def _nvidia_smi(program: str, env: Mapping[str, str]) -> list[SeenGpu]:
    argv = list(NVIDIA_SMI_QUERY)
    visible = _visible(env, ("CUDA_VISIBLE_DEVICES",))
    if visible and "MIG-" in visible:
        # A MIG instance has a share of its GPU's memory, bandwidth and SMs; the table
        # describes whole GPUs, and nvidia-smi's --query-gpu the parent GPU.
        raise TreetuneError(
            f"the GPUs on {socket.gethostname()} are MIG instances ({visible}), which treetune"
            "'s GPU table cannot describe (each has only a share of its GPU's memory and "
            "bandwidth): write a profile for them and give it with --prior FILE")
    if visible:  # nvidia-smi takes the same indices or UUIDs
        argv.append(f"--id={visible}")
    output = _run(program, argv, env)
    # "NVIDIA H100 80GB HBM3, 81559 MiB" each; a bracketed word where a GPU says no memory
    # ([N/A] on GB10, [Not Supported], [Insufficient Permissions]). A line of another shape
    # is no GPU (a warning, a wrapper's chatter).
    found = [m for line in output.splitlines()
             if (m := NVIDIA_LINE.fullmatch(line.strip())) is not None]
    if not found:
        raise _lists_no_gpu(Path(program).name, output, "no GPU listed")
    return [SeenGpu(m["name"].strip(), float(m["mib"]) if m["mib"] else None) for m in found]


NVIDIA_LINE = re.compile(
    r"(?P<name>[^,]*\S[^,]*),\s*(?:(?P<mib>\d+(?:\.\d+)?)\s*MiB|\[[^\]]*\]|N/A)")


# HIP reads HIP_VISIBLE_DEVICES (what Ray sets on AMD nodes), then CUDA_VISIBLE_DEVICES;
# ROCR_VISIBLE_DEVICES filters below it. Any of them gives the indices the worker may use,
# and each is set per worker (a study's `env` may not set one for every server).
AMD_VISIBLE = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
DEVICE_VARIABLES = frozenset(AMD_VISIBLE)  # CUDA's is among them


def _amd_smi(program: str, env: Mapping[str, str]) -> list[SeenGpu]:
    """`amd-smi static --asic --vram --json`: a list of GPUs (older releases) or
    {"gpu_data": [...]}, each with asic.market_name and vram's size."""
    output = _run(program, AMD_SMI_QUERY, env)
    data = _json(output, "amd-smi")
    rows = data.get("gpu_data", []) if isinstance(data, dict) else data
    seen = {}
    for position, row in enumerate(rows if isinstance(rows, list) else []):
        asic = row.get("asic", {}) if isinstance(row, dict) else {}
        name = asic.get("market_name") if isinstance(asic, dict) else None
        if isinstance(name, str) and name.strip() and name.strip() != "N/A":
            index = row.get("gpu", position)
            seen[index if isinstance(index, int) else position] = SeenGpu(
                name.strip(), _amd_smi_mib(row.get("vram")), "amd-smi")
    return _keep_visible(seen, env, "amd-smi", output)


def _amd_smi_mib(vram: object) -> float | None:
    if not isinstance(vram, dict):
        return None
    size = vram.get("size", vram.get("vram_size"))
    if isinstance(size, dict) and isinstance(size.get("value"), int | float):
        scale = {"B": 2.0**-20, "KB": 2.0**-10, "MB": 1.0, "GB": 1024.0}
        return float(size["value"]) * scale.get(str(size.get("unit", "MB")).upper(), 1.0)
    mib = vram.get("vram_size_mb")
    return float(mib) if isinstance(mib, int | float) else None


def _rocm_smi(program: str, env: Mapping[str, str]) -> list[SeenGpu]:
    """`rocm-smi --showproductname --showmeminfo vram --json`: {"card0": {"Card series":
    ..., "VRAM Total Memory (B)": ...}, ...}, the key's case varying by release. rocm-smi
    can exit 0 when it finds no GPU, so its output is the only signal."""
    output = _run(program, ROCM_SMI_QUERY, env)
    data = _json(output, "rocm-smi")
    if isinstance(data, dict) and isinstance(data.get("system"), dict) and not any(
            k.startswith("card") for k in data):
        data = data["system"]
    cards = sorted(((int(k[4:]), v) for k, v in (data.items() if isinstance(data, dict)
                    else ()) if re.fullmatch(r"card\d+", k) and isinstance(v, dict)))
    seen = {}
    for position, (_, fields) in enumerate(cards):  # -d and HIP count cards in this order
        by_key = {str(k).lower(): v for k, v in fields.items()}
        name = by_key.get("card series") or by_key.get("card model")
        if isinstance(name, str) and name.strip():
            memory = by_key.get("vram total memory (b)")
            mib = float(memory) / 2**20 if re.fullmatch(r"\d+", str(memory)) else None
            seen[position] = SeenGpu(name.strip(), mib, "rocm-smi")
    return _keep_visible(seen, env, "rocm-smi", output)


def _json(output: str, tool: str) -> object:
    try:
        return json.loads(output)
    except json.JSONDecodeError:
        raise _lists_no_gpu(tool, output, "no JSON") from None


def _keep_visible(seen: dict[int, SeenGpu], env: Mapping[str, str], tool: str,
                  output: str) -> list[SeenGpu]:
    if not seen:
        raise _lists_no_gpu(tool, "", f"no GPU in its output: {output.strip()[:80]}")
    visible = _visible(env, AMD_VISIBLE)
    indices = visible.split(",") if visible else []
    if indices and all(i.strip().isdigit() for i in indices):
        seen = {i: seen[i] for i in (int(i) for i in indices) if i in seen}
        if not seen:
            raise _lists_no_gpu(tool, "", f"no GPU among {visible}")
    return list(seen.values())


@dataclass(frozen=True)
class SmiTool:
    program: str
    query: Callable[[str, Mapping[str, str]], list[SeenGpu]]


SMI_TOOLS = (SmiTool("nvidia-smi", _nvidia_smi), SmiTool("amd-smi", _amd_smi),
             SmiTool("rocm-smi", _rocm_smi))


def seen_model(env: Mapping[str, str] | None = None) -> str | None:
    """The model of the GPUs this process sees: its GPU table entry's name, else as the
    node's tool names it (several joined by ' + '; MIG instances as such), or None when no
    tool tells. What a study's workers must agree on, since Ray's accelerator type names
    some models alike (H100 SXM and PCIe: H100)."""
    visible = _visible(dict(os.environ if env is None else env), ("CUDA_VISIBLE_DEVICES",))
    if visible and "MIG-" in visible:
        return "MIG instances"  # a share of a GPU: never one of the table's whole GPUs
    try:
        seen = query_gpus(env)
    except TreetuneError:
        return None
    names = set()
    for gpu in seen:
        try:
            names.add(gpu_facts(gpu.name).name)  # one entry, whichever tool named it
        except TreetuneError:
            names.add(gpu.name)
    return " + ".join(sorted(names)) or None


def detect_gpu(env: Mapping[str, str] | None = None) -> GpuFacts:
    """The table's entry for the GPU this process sees (every visible GPU must be the
    same model: a server's tensor-parallel group runs at its slowest GPU's pace)."""
    seen = query_gpus(env)
    names = sorted({g.name for g in seen})
    if len(names) > 1:
        raise TreetuneError(f"the GPUs on {socket.gethostname()} differ ({', '.join(names)}):"
                            f" name the one to model with {OVERRIDE}")
    memory = f", {seen[0].memory_mib:.0f} MiB" if seen[0].memory_mib else ""
    return gpu_facts(names[0], f"{seen[0].tool} on {socket.gethostname()}{memory}")
