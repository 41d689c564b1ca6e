"""What a report says about the machine it measured on (core/machine.py)."""

from specbuild.core import machine

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni
processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: something else
flags\t\t: fpu
"""


def test_cpu_info_names_the_model_vendor_and_the_kernel_relevant_isa():
    info = machine.cpu_info(CPUINFO)
    assert info["model"] == "AMD EPYC 9R14 96-Core Processor"         # the first processor speaks for all
    assert info["vendor"] == "AuthenticAMD"
    assert info["isa"] == ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"]


def test_cpu_info_without_proc_still_answers():
    info = machine.cpu_info("")
    assert info["isa"] == [] and info["vendor"] is None and isinstance(info["model"], str)


def test_describe_and_its_one_line():
    d = machine.describe()
    assert d["cpu_count"] >= 1 and isinstance(d["isa"], list) and d["cpu"]
    line = machine.one_line({"cpu": "AMD EPYC 9R14", "cpu_count": 2, "isa": ["avx2", "avx512f"]})
    assert line == "AMD EPYC 9R14, 2 CPUs (avx2 avx512f)"
