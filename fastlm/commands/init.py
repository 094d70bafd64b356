"""`fastlm init DIR`: copy a recipe (a folder of configs and user code shipped inside the package, so it is
there after `pip install`) into DIR. Every path in a recipe is relative to its own files, so the copy works
from any working directory; README "Recipe" walks through it."""

from __future__ import annotations

import shutil
from pathlib import Path

from fastlm.commands.errors import exit_status

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_RECIPE = "lora_chat"


def recipe_names() -> list[str]:
    return sorted(path.name for path in RECIPES.iterdir() if path.is_dir() and not path.name.startswith("_"))


def recipe_files(name: str) -> list[Path]:
    return sorted(path for path in (RECIPES / name).iterdir() if path.is_file() and path.suffix in (".yaml", ".py"))


def init_command(directory: str, recipe: str) -> int:
    """Copies the recipe's files into `directory` (made if missing); refuses, before copying anything, to
    overwrite a file that is there."""
    if recipe not in recipe_names():
        return exit_status(f"no recipe {recipe!r}; the recipes are {', '.join(recipe_names())}", command="fastlm init")
    target = Path(directory)
    if target.exists() and not target.is_dir():
        return exit_status(f"{target} is a file, not a folder; name a new or existing folder", command="fastlm init")
    files = recipe_files(recipe)
    taken = [target / file.name for file in files if (target / file.name).exists()]
    if taken:
        return exit_status(f"{taken[0]} exists (and {len(taken) - 1} more of the recipe's files); copy into another "
                           "folder or move them away", command="fastlm init")
    target.mkdir(parents=True, exist_ok=True)
    for file in files:
        shutil.copyfile(file, target / file.name)
    print(f"wrote {', '.join(file.name for file in files)} to {target} (recipe {recipe})")
    return 0
