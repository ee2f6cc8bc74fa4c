"""docs/ARCHITECTURE.md is the map of src/loom: every folder and top-level module is named there (`name/` or
`name.py`, in backquotes), so a new part of loom cannot land without its place on the map."""

from pathlib import Path

import loom

ROOT = Path(loom.__file__).parent
MAP = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"


def test_every_folder_and_module_of_src_loom_is_on_the_map():
    text = MAP.read_text(encoding="utf-8")
    parts = [f"{p.name}/" for p in ROOT.iterdir() if (p / "__init__.py").is_file()]
    parts += [p.name for p in ROOT.glob("*.py")]
    missing = sorted(p for p in parts if f"`{p}`" not in text and f"`{p.removesuffix('.py')}`" not in text)
    assert not missing, f"add to docs/ARCHITECTURE.md: {missing}"


def test_the_readme_points_to_the_map_in_the_repository():
    readme = (MAP.parents[1] / "README.md").read_text(encoding="utf-8")
    assert "docs/ARCHITECTURE.md" in readme and "../shared/design" not in readme
