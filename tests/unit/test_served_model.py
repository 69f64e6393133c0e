"""What the controller reads of the model folder, and the one-line errors a broken config.json
gets instead of a KeyError or a JSON traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.app import config_int, read_model_config
from controller.scheduler import ConfigError


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{", "a readable config.json"),
        ("[1, 2]", "holds an object"),
    ],
)
def test_an_unreadable_config_names_the_folder(tmp_path: Path, text: str, why: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=why) as err:
        read_model_config(str(tmp_path))
    assert err.value.field == "model_dir" and str(tmp_path) in str(err.value)


def test_integer_fields_are_named_when_missing_or_wrong(tmp_path: Path) -> None:
    folder = str(tmp_path)
    assert config_int({"vocab_size": 320}, "vocab_size", folder) == 320
    assert config_int({}, "max_position_embeddings", folder, 0) == 0
    assert config_int({"max_position_embeddings": None}, "max_position_embeddings", folder, 0) == 0
    for config in ({}, {"vocab_size": "320"}, {"vocab_size": True}, {"vocab_size": -1}):
        with pytest.raises(ConfigError, match="whose vocab_size is an integer >= 0"):
            config_int(config, "vocab_size", folder)
