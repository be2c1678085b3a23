"""notebooks/quickstart.ipynb runs top to bottom on CPU with its small setting (KASCADE_NOTEBOOK_SMALL=1), through
nbclient and an ipykernel kernel of this very interpreter (a kernelspec written to a temporary JUPYTER_PATH, so the
kernel is never some other python on PATH). A failing cell fails the test with the cell's error."""

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


def test_notebook_is_stored_without_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, cell["source"][:80]


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    spec_dir = tmp_path / "jupyter" / "kernels" / "kascade-test"
    spec_dir.mkdir(parents=True)
    env = {"JAX_PLATFORMS": "cpu", "KASCADE_NOTEBOOK_SMALL": "1", "PYTHONPATH": str(ROOT),
           "MPLBACKEND": "Agg", "KASCADE_JAX_CALIBRATION_DIR": str(tmp_path / "calibration")}
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "kascade-test", "language": "python", "env": env}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter-data"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter-runtime"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend shows the heatmap
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="kascade-test", timeout=600,
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "anchors of the recipe: (0, 2, 8, 18, 21, 24) decode budget: 0.3" in text and "[kascade]" in text and "M=5: anchors [0," in text, text
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.outputs), "no S heatmap"
    assert "niah_single_2" in text and "kascade" in text.split("niah_single_2", 1)[1], text
