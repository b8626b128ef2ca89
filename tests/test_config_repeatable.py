"""Repeatable flags (`--spoke_nfs.mount` and the like) from the YAML file and from the chart's values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from stallwatch.exporters import agent  # noqa: F401  (registers every collector)
from stallwatch.exporters.collector import registered
from stallwatch.exporters.config import ConfigError, ignored_settings, parse
from tests.test_helm import agent_config, chart, helm, render, values_file  # noqa: F401  (fixtures)


def parsed(tmp_path: Path, config: dict[str, Any], *argv: str) -> Any:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return parse(["--config.file", str(path), *argv], registered())


def test_a_list_or_one_value_sets_a_repeatable_flag(tmp_path: Path) -> None:
    assert parsed(tmp_path, {"spoke_nfs.mount": "a=/mnt/a"}).spoke_nfs_mount == [("a", "/mnt/a")]
    both = parsed(tmp_path, {"spoke_nfs.mount": ["a=/mnt/a", "b=/mnt/b"]})
    assert dict(both.spoke_nfs_mount) == {"a": "/mnt/a", "b": "/mnt/b"}
    # the command line adds to what the file sets, as repeating the flag does
    more = parsed(tmp_path, {"spoke_nfs.mount": ["a=/mnt/a"]}, "--spoke_nfs.mount", "c=/mnt/c")
    assert dict(more.spoke_nfs_mount) == {"a": "/mnt/a", "c": "/mnt/c"}


@pytest.mark.parametrize(("value", "message"), [
    (["a=/mnt/a", "b"], "spoke_nfs.mount: expected NAME=/mount/point, got 'b'"),
    ([["a=/mnt/a"]], "spoke_nfs.mount needs one value"),
    ({"a": "/mnt/a"}, "spoke_nfs.mount needs one value"),
])
def test_a_bad_item_is_a_one_line_error(tmp_path: Path, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        parsed(tmp_path, {"spoke_nfs.mount": value})
    assert "\n" not in str(error.value)


def test_the_chart_passes_a_list_the_agent_accepts(helm: str, chart: Path, tmp_path: Path) -> None:  # noqa: F811
    values = {"agent": {"config": {"collector.spoke_nfs": True, "spoke_nfs.mount": ["a=/mnt/a", "b=/mnt/b"]}}}
    config = agent_config(render(helm, chart, values_file(tmp_path, "nfs", values)))
    assert config["spoke_nfs.mount"] == ["a=/mnt/a", "b=/mnt/b"]
    keep = {k: v for k, v in config.items() if k.startswith(("collector.spoke_nfs", "spoke_nfs."))}
    assert dict(parsed(tmp_path, keep).spoke_nfs_mount) == {"a": "/mnt/a", "b": "/mnt/b"}


def test_a_setting_of_a_collector_that_is_off_is_named_with_how_to_turn_it_on(tmp_path: Path) -> None:
    """docs/deploy.md once set `spoke_nfs.mount` without the collector: silently ignored."""
    options = parsed(tmp_path, {"spoke_nfs.mount": "fsx=/fsx"})
    assert ignored_settings(options, registered()) == [
        "--spoke_nfs.mount is set but the spoke_nfs collector is off, so it does nothing: turn it on with "
        "--collector.spoke_nfs"]
    assert ignored_settings(parsed(tmp_path, {"spoke_nfs.mount": "fsx=/fsx", "collector.spoke_nfs": True}),
                            registered()) == []
    assert ignored_settings(parsed(tmp_path, {}), registered()) == []
