"""The public API: every exported name resolves, and none of it needs trl, wandb or vllm."""

from __future__ import annotations

import subprocess
import sys

import lightning_tlt


def test_every_export_resolves_to_its_module() -> None:
    for name in lightning_tlt.__all__:
        value = getattr(lightning_tlt, name)
        assert getattr(value, "__name__", name) == name or not callable(value), name
    assert "RolloutEngine" in dir(lightning_tlt)


def test_public_api_imports_without_trl_wandb_vllm() -> None:
    # None in sys.modules makes any import of these packages fail: the kit must import them lazily
    code = (
        "import sys\n"
        "for m in ('trl', 'wandb', 'vllm'): sys.modules[m] = None\n"
        "import lightning_tlt\n"
        "[getattr(lightning_tlt, n) for n in lightning_tlt.__all__]\n"
        "print('ok', len(lightning_tlt.__all__))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        lightning_tlt.NoSuchThing  # noqa: B018
    except AttributeError as err:
        assert "NoSuchThing" in str(err)
    else:
        raise AssertionError("expected AttributeError")
