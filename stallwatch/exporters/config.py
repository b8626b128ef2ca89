"""The agent's configuration: exporter-style flags, optionally preset by a YAML file.

The file is a flat mapping of flag names without their dashes (`web.listen-address: ":9842"`,
`collector.gpu: false`, `gpu.interval: 0.25`); a repeatable flag takes a list or one value
(`spoke_nfs.mount: [a=/mnt/a, b=/mnt/b]`). Flags on the command line win over the file. Every
mistake, in a flag or in the file, is a `ConfigError` with a one-line message.

Every number is range-checked by its flag type (`stallwatch.flags`), and every YAML file the agent
reads (this one, `--web.config.file`, mapping files) goes through `load_yaml`, which bounds the time
and memory any content can cost: at most 1 MiB, no aliases (the "billion laughs"), nesting at most 32
deep, and messages that quote at most a few dozen characters of a value.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import yaml
from yaml.composer import ComposerError

from stallwatch.build import version_text
from stallwatch.exporters.collector import DEFAULT_TIMEOUT_S, WEDGED_DEADLINES, CollectorSpec
from stallwatch.exporters.logformat import FORMATS
from stallwatch.flags import cut, positive_float, shown

DEFAULT_PORT = 9842
DEFAULT_LISTEN_ADDRESS = f":{DEFAULT_PORT}"
MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 32


class ConfigError(Exception):
    """A bad flag or configuration file; the message is one line for the user."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser(collectors: Mapping[str, CollectorSpec]) -> argparse.ArgumentParser:
    parser = _Parser(prog="stallwatch agent", description="Serve GPU, host, loader and spoke metrics.")
    parser.add_argument("--version", action="version", version=version_text("stallwatch agent"))
    parser.add_argument("--config.file", dest="config_file", metavar="PATH",
                        help="YAML file presetting any of these flags (names without the dashes)")
    parser.add_argument("--web.listen-address", dest="web_listen_address", default=DEFAULT_LISTEN_ADDRESS,
                        metavar="[HOST]:PORT", help="where /metrics is served (default: %(default)s)")
    parser.add_argument("--web.telemetry-path", dest="web_telemetry_path", default="/metrics", metavar="PATH",
                        help="path of the metrics endpoint (default: %(default)s)")
    parser.add_argument("--web.config.file", dest="web_config_file", metavar="PATH",
                        help="TLS and basic auth for every path, in the Prometheus exporter toolkit's format")
    parser.add_argument("--log.level", dest="log_level", default="info",
                        choices=["debug", "info", "warning", "error"], help="(default: %(default)s)")
    parser.add_argument("--log.format", dest="log_format", default="logfmt", choices=FORMATS,
                        help="how each log line is written (default: %(default)s)")
    parser.add_argument("--collector.timeout", dest="collector_timeout", type=positive_float, default=DEFAULT_TIMEOUT_S,
                        metavar="SECONDS", help="a collector that takes longer on a scrape is reported failed and the "
                        "rest are served; keep it under Prometheus's scrape timeout. One still running after "
                        f"{WEDGED_DEADLINES} times this makes /-/healthy fail (default: %(default)s)")
    enable = parser.add_argument_group("collectors")
    for name, spec in collectors.items():
        state = "on" if spec.default_enabled else "off"
        enable.add_argument(f"--collector.{name}", dest=f"collector_{name}", default=spec.default_enabled,
                            action=argparse.BooleanOptionalAction,
                            help=f"{spec.description} (default: {state})")
    for name, spec in collectors.items():
        if spec.add_arguments is not None:
            spec.add_arguments(parser.add_argument_group(f"{name} collector"))
    return parser


class _BoundedLoader(yaml.SafeLoader):
    """safe_load without aliases and with bounded nesting, so no content costs unbounded time, memory
    or stack: through aliases a few hundred bytes can stand for billions of values."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._refuse("aliases (*name) are not allowed")
        if self._depth >= MAX_YAML_DEPTH:
            self._refuse(f"nested deeper than {MAX_YAML_DEPTH} levels")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def _refuse(self, problem: str) -> NoReturn:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        raise ComposerError(None, None, problem, event.start_mark)


def read_bounded(path: str) -> str:
    """The text of a configuration file of at most MAX_YAML_BYTES (so /dev/zero is an error, not a hang)."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_YAML_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror}") from error
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_YAML_BYTES >> 10} KiB, not a configuration file")
    try:
        return data.decode()
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte {error.start})") from error


def parse_yaml(text: str, origin: str) -> Any:
    """A YAML document, bounded as `_BoundedLoader` is; every problem is a one-line `ConfigError`."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise ConfigError(f"{origin}: not valid YAML{line}: {shown(problem, 80)}") from error
    except ValueError as error:  # a scalar int() refuses, such as an integer of more than 4,300 digits
        raise ConfigError(f"{origin}: not valid YAML: {shown(str(error), 80)}") from error


def load_yaml(path: str) -> Any:
    return parse_yaml(read_bounded(path), path)


def _load_file(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    document = load_yaml(path)
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values, got {type(document).__name__}")
    actions = {opt[2:]: action for action in parser._actions for opt in action.option_strings}
    values: dict[str, Any] = {}
    for key, raw in document.items():
        action = actions.get(str(key))
        if action is None or key in ("config.file", "help"):
            raise ConfigError(f"{path}: unknown option {shown(key)}")
        if isinstance(action, argparse._AppendAction):
            # A repeatable flag: a list of values, or one value, as if the flag were given that often.
            items = raw if isinstance(raw, list) else [raw]
            values[action.dest] = [_file_value(path, key, action, item) for item in items]
        else:
            values[action.dest] = _file_value(path, key, action, raw)
    return values


def _file_value(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    """One value of the file, converted and checked as the flag would be on the command line."""
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {key} must be true or false, got {shown(value)}")
    elif value is None or isinstance(value, list | dict):
        raise ConfigError(f"{path}: {key} needs one value, got {shown(value)}")
    elif action.type is None:
        value = str(value)
    else:
        try:
            value = action.type(str(value))  # type: ignore[operator]
        except (ValueError, argparse.ArgumentTypeError) as error:
            raise ConfigError(f"{path}: {key}: {cut(str(error), 120)}") from error
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{path}: {key} must be one of {', '.join(map(str, action.choices))}")
    return value


def parse(argv: Sequence[str], collectors: Mapping[str, CollectorSpec]) -> argparse.Namespace:
    parser = build_parser(collectors)
    options = parser.parse_args(argv)
    if options.config_file:
        parser.set_defaults(**_load_file(parser, options.config_file))
        options = parser.parse_args(argv)
    parse_listen_address(options.web_listen_address)
    if not options.web_telemetry_path.startswith("/"):
        raise ConfigError(f"--web.telemetry-path must start with /, got {options.web_telemetry_path!r}")
    return options


def ignored_settings(options: argparse.Namespace, collectors: Mapping[str, CollectorSpec]) -> list[str]:
    """One line per setting of a collector that is off (it would be silently ignored), naming how to turn it on.
    A warning, not an error: a chart may set a collector's paths whether or not it is on."""
    parser = build_parser(collectors)
    lines = []
    for name in collectors:
        if getattr(options, f"collector_{name}"):
            continue
        for action in parser._actions:
            if action.dest.startswith(f"{name}_") and getattr(options, action.dest) != action.default:
                lines.append(f"{action.option_strings[0]} is set but the {name} collector is off, so it does "
                             f"nothing: turn it on with --collector.{name}")
    return lines


def parse_listen_address(address: str) -> tuple[str, int]:
    """`:9842`, `127.0.0.1:9842`, `[::1]:9842` -> (host, port); an empty host means every interface."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {address!r} is not [HOST]:PORT")
    return host.strip("[]"), int(port)


def log_level(name: str) -> int:
    return int(getattr(logging, name.upper()))
