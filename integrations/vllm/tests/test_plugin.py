"""The ``vllm.general_plugins`` entry point: vLLM finds it, registering twice is harmless, and it
imports nothing of ckpt-core, so a broken ckpt-core never stops vLLM from starting; selecting
the backend on such an install is an ``ImportError`` that says what is broken."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CHECK = textwrap.dedent(
    """
    import sys
    from vllm.plugins import load_general_plugins
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from ckpt_vllm.plugin import register

    load_general_plugins()  # vLLM's own loader, as in each of its processes
    register()  # and again: idempotent
    assert "ckpt" in WeightTransferEngineFactory._registry and "ckpt" in WeightTransferTrainerFactory._registry
    assert not any(name.startswith("ckpt_core") for name in sys.modules), "registering imported ckpt-core"
    try:
        engine_class = WeightTransferEngineFactory._registry["ckpt"]()  # what selecting it loads
    except ImportError as exc:
        print("IMPORT ERROR:", exc)
    else:
        print("LOADED:", engine_class.__name__)
    """
)


def _run(cwd: Path) -> str:
    """``CHECK`` in a fresh interpreter whose first import path is ``cwd``."""
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=240, cwd=cwd)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_vllm_finds_the_backend_and_registering_again_is_harmless(tmp_path: Path) -> None:
    assert "LOADED: CkptWeightTransferEngine" in _run(tmp_path)


def test_a_broken_ckpt_core_is_a_clear_error_only_when_the_backend_is_selected(tmp_path: Path) -> None:
    broken = tmp_path / "ckpt_core"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('ckpt-core broken on purpose')\n")
    out = _run(tmp_path)  # its ckpt_core is found before the installed one
    assert "IMPORT ERROR: vLLM's weight-transfer backend 'ckpt' (ckpt-vllm) cannot import ckpt-core" in out, out
    assert "ckpt-core broken on purpose" in out and "pip install ckpt-core" in out, out
