"""python/examples/hf_llama_paged.py as a test: a small Hugging Face Llama (seeded random weights,
nothing downloaded) served through KvattnAttnBackend with continuous batching (EXTEND, MIXED and
DECODE steps over a paged pool), its tokens compared one by one with model.generate and its
logits with the model's own. Needs torch and transformers: skipped without them, except in CI,
which installs both and sets KVATTN_REQUIRE_TORCH=1 (then a missing one fails)."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import pytest

if os.environ.get("KVATTN_REQUIRE_TORCH") == "1":
    import torch
    import transformers  # noqa: F401
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

import kvattn  # noqa: E402

EXAMPLE = Path(__file__).parents[1] / "examples" / "hf_llama_paged.py"


def devices():
    found = ["cpu"]
    if torch.cuda.is_available() and kvattn.cuda_compiled():
        found.append("cuda")
    return found


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed", [0, 1])
def test_hf_llama_served_through_kvattn(device, seed, capsys):
    example = runpy.run_path(str(EXAMPLE), run_name="hf_llama_paged")
    status = example["main"](["--device", device, "--seed", str(seed)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "OK: 8 requests" in out
