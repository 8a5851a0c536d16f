"""Helpers shared by the validation scripts (validation-report, validation-sweep,
validation-holdout): the error statistics nnsim validate prints, calibration files that set
chosen cost-model constants, and one `nnsim validate` run over a subset of a set's cases.
"""
import json
import math
import os
import statistics
import subprocess

import yaml


def p90(values):
    a = sorted(values)
    pos = 0.9 * (len(a) - 1)
    lo = math.floor(pos)
    hi = min(len(a) - 1, lo + 1)
    return a[lo] + (pos - lo) * (a[hi] - a[lo])


def summary(errors):
    a = [abs(e) for e in errors]
    return f"median {statistics.median(a):5.2f}  p90 {p90(a):5.1f}  mean {sum(a) / len(a):5.2f}"


def stats(errors):
    """Count, median, p90, max and mean of the absolute errors, one line."""
    a = sorted(abs(e) for e in errors)
    if not a:
        return "no cases"
    return (f"{len(a)} cases: median {statistics.median(a):.1f} %, p90 {p90(a):.1f} %, "
            f"max {a[-1]:.1f} %, mean {sum(a) / len(a):.1f} %")


def load_cases(path):
    with open(path) as f:
        doc = yaml.safe_load(f)
    return doc["cases"] if isinstance(doc, dict) else doc


def parallel_stated(case):
    return not any(a.startswith("parallel.") for a in case.get("assumed", []))


def own_attention(case):
    """Megatron on Hopper runs Transformer Engine's fused attention, whose efficiencies are not
    FlashAttention-2's; everywhere else the GPU's FlashAttention-2 pair prices the attention."""
    return (case["parallel"]["framework"] == "megatron"
            and case["cluster"]["gpu"].startswith(("h100", "h200")))


def calibration(nnsim, path, gpus, attrs):
    """Writes a calibration file for `gpus` holding only the compute attributes `attrs`."""
    import h5py  # only the scripts that write calibration files need it
    args = [nnsim, "calibration", "export", "-o", path]
    for g in gpus:
        args += ["--gpu", g]
    subprocess.run(args, check=True, capture_output=True)
    with h5py.File(path, "r+") as f:
        for g in gpus:
            if "comm" in f[g]:
                del f[g + "/comm"]
            a = f[g + "/compute"].attrs
            for k in list(a.keys()):
                if k not in attrs:
                    del a[k]
            for k, v in attrs.items():
                a[k] = v


def validate_cases(nnsim, case_set, jobs, ids, calib, tmp):
    """The per-case results of `nnsim validate --json` for the cases `ids`."""
    if not ids:
        return []
    out = os.path.join(tmp, "v.json")
    args = [nnsim, "validate", case_set, "--jobs", str(jobs), "--json", out]
    if calib:
        args += ["--calib", calib]
    subprocess.run(args + ["--only"] + ids, check=True, capture_output=True)
    with open(out) as f:
        return json.load(f)["cases"]


def validate(nnsim, case_set, jobs, ids, calib, tmp):
    """Signed iteration-time errors (%) of the cases `ids`, by id."""
    return {c["id"]: c["error_pct"]
            for c in validate_cases(nnsim, case_set, jobs, ids, calib, tmp)}
