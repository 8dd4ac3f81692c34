"""What CPU this is: the model name, the instruction-set flags that matter for sparrow's kernels, and core counts."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 instructions that compute in bfloat16 (ARM: "bf16" in Features)


RELEVANT_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",  # x86
    "asimd", "asimddp", "bf16", "i8mm", "sve", "sve2",  # ARM (the Features line)
)



@dataclass(frozen=True)
class CpuInfo:
    model: str  # "AMD EPYC 9R14 (family 25 model 17)", or what the platform says where /proc/cpuinfo has none
    arch: str  # platform.machine(): x86_64, aarch64, ...
    flags: tuple[str, ...]  # the RELEVANT_FLAGS the CPU has, in that order
    logical_cpus: int
    physical_cores: int | None  # None: /proc/cpuinfo does not say

    @property
    def bf16(self) -> bool:
        """Whether the CPU has instructions that compute in bfloat16 (rather than torch emulating them)."""
        arm = self.arch in ("aarch64", "arm64") and "bf16" in self.flags
        return arm or any(flag in self.flags for flag in BF16_FLAGS)

    @property
    def bf16_flags(self) -> list[str]:
        return [flag for flag in (*BF16_FLAGS, "bf16") if flag in self.flags]



def read_cpuinfo() -> str:
    """The text of /proc/cpuinfo ("" where there is none: not Linux, or unreadable). Tests replace this."""
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""



def parse_cpuinfo(text: str) -> CpuInfo:
    """The CpuInfo of a /proc/cpuinfo text (x86's `flags` or ARM's `Features`)."""
    model, flags, cores = "", set(), set()
    physical_id, family, number = "", "", ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value
        elif key == "cpu family" and not family:
            family = value
        elif key == "model" and not number:
            number = value
        elif key in ("flags", "features"):
            flags.update(value.split())
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            cores.add((physical_id, value))
    if model and family and number:  # a virtual machine's "AMD EPYC" is Zen 4 or Zen 5: the numbers say which
        model = f"{model} (family {family} model {number})"
    return CpuInfo(model=model or platform.processor() or platform.machine() or "unknown CPU",
                   arch=platform.machine(), flags=tuple(f for f in RELEVANT_FLAGS if f in flags),
                   logical_cpus=os.cpu_count() or 1, physical_cores=len(cores) or None)



def cpu_info() -> CpuInfo:
    return parse_cpuinfo(read_cpuinfo())

