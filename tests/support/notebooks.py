"""Running a notebook top to bottom in an IPython kernel of a chosen interpreter, and what
every run of one must show."""

import json
import pathlib
import time

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
CELL_TIMEOUT_S = 300
KERNEL = "meshtrain-test-python3"


def code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def kernel_spec(jupyter_path: pathlib.Path, python: str) -> None:
    """A kernelspec under JUPYTER_PATH `jupyter_path` that starts `python` (no installed
    kernelspec needed)."""
    spec = jupyter_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "meshtrain tests", "language": "python"}))


def execute(name: str, env: dict, cwd: pathlib.Path, monkeypatch):
    """notebooks/NAME run in the KERNEL kernel (found through env's JUPYTER_PATH, which this
    process needs too) from `cwd` -> (the notebook with its outputs, seconds)."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PATH", env["JUPYTER_PATH"])
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL, allow_errors=False,
                            resources={"metadata": {"path": str(cwd)}})
    t0 = time.perf_counter()
    client.execute(env=env)
    return nb, time.perf_counter() - t0


def assert_runs_and_draws(name: str, nb) -> None:
    """No cell failed, every cell that shows a figure drew one, and the layouts notebook
    compared its five layouts with dp8 and the image layout with one device."""
    errors = [o for c in code_cells(nb) for o in c.outputs if o.output_type == "error"]
    assert not errors, [f"{o.ename}: {o.evalue}" for o in errors]
    figures = 0
    for i, c in enumerate(code_cells(nb)):
        images = [o for o in c.outputs if "image/png" in o.get("data", {})]
        if "plt.show()" in c.source:
            assert images, f"{name}: code cell {i} should draw a figure:\n{c.source}"
        figures += len(images)
    assert figures >= (6 if name == "layouts.ipynb" else 1)
    text = "".join(o.get("text", "") for c in code_cells(nb) for o in c.outputs)
    if name == "layouts.ipynb":
        assert text.count("max rel diff vs dp8") == 5
        assert text.count("max rel diff vs one device") == 1  # the image model's spatial layout
    return figures
