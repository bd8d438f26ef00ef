"""The key reference: docs/configuration.md is what ``streamflow config keys`` prints, and that
lists every key a run config accepts, with its real default and a comment."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from streamflow.cli import main
from streamflow.config import RunConfig, config_to_dict, load_config
from streamflow.config.keys import _comment_blocks, config_keys, render
from workers.checked import bounded

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_docs_configuration_md_is_up_to_date():
    # Fails after a key is added, renamed or re-commented: regenerate the file with
    # `streamflow config keys > docs/configuration.md`.
    assert DOC.read_text() == render()


def test_streamflow_config_keys_prints_the_reference(capsys):
    assert main(["config", "keys"]) == 0
    assert capsys.readouterr().out == render()


def _flat(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in tree.items():
        if isinstance(value, dict):
            keys |= _flat(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def test_every_key_of_the_config_is_listed_once_with_a_comment():
    keys = config_keys()
    names = [k.key for k in keys]
    assert len(names) == len(set(names))
    # the keys a resolved config.yaml holds (list items aside) are exactly the ones listed
    assert {n for n in names if "[]" not in n} == _flat(config_to_dict(RunConfig()))
    assert {"placement.nodes[].host", "placement.nodes[].trainer"} <= set(names)
    assert [k.key for k in keys if not k.comment] == []


def test_every_listed_default_is_the_default_a_run_gets():
    # key=default as an override (as a user would type it) changes nothing
    for k in config_keys():
        if "[]" not in k.key:
            assert load_config(None, [f"{k.key}={k.default}"]) == RunConfig(), k


@dataclass(frozen=True)
class _Example:
    plain: int = 0
    # above one field
    commented: int = bounded(1, ge=0)  # and on its line
    # one comment above two fields, which share it
    first: str = "a"
    second: str = "b"

    lone: bool = False
    multi: float = bounded(  # on the first line of a multi-line field
        1.0, gt=0)


def test_comments_are_read_from_above_a_field_and_its_own_lines():
    assert _comment_blocks(_Example) == {
        "plain": "",
        "commented": "above one field and on its line",
        "first": "one comment above two fields, which share it",
        "second": "one comment above two fields, which share it",
        "lone": "",  # a blank line ends a shared comment
        "multi": "on the first line of a multi-line field",
    }
