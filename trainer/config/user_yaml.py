"""The one home for reading YAML a user wrote (run.yaml, `--set` values, facts files): PyYAML's safe
loader, except that a mapping that says a key twice is refused, naming the key's path and both lines,
instead of the last one silently winning (`lr: 3e-4` ... `lr: 1` trains at 1). Merge keys (`<<: *x`)
may still be overridden, as YAML means them to be. Light side: no torch.

`safe_load` is a drop-in for `yaml.safe_load`: every problem is a `yaml.YAMLError`, so a caller's
existing `except yaml.YAMLError` turns it into its own one-line refusal."""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MERGE = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping in the document says one key twice."""


class TooDeepError(yaml.YAMLError):
    """Nesting deeper than the parser recurses (no config is nested like that)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that checks every mapping's keys before it builds anything."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        self._check_keys(node, "", set())
        return self.construct_document(node)

    def _key_of(self, node: Node) -> Any:
        if isinstance(node, ScalarNode):
            return self.construct_object(node)  # `1`, `0x1` and `+1` are one key; `"1"` another
        return ("node", id(node))  # a complex key: PyYAML's own constructor refuses it

    def _check_keys(self, node: Node, path: str, seen_nodes: set[int]) -> None:
        if id(node) in seen_nodes:  # an alias of a node already checked
            return
        seen_nodes.add(id(node))
        if isinstance(node, SequenceNode):
            for i, item in enumerate(node.value):
                self._check_keys(item, f"{path}[{i}]", seen_nodes)
        elif isinstance(node, MappingNode):
            first: dict[Any, tuple[int, int]] = {}
            for key_node, value_node in node.value:
                if key_node.tag == MERGE:
                    self._check_keys(value_node, path, seen_nodes)
                    continue
                key = self._key_of(key_node)
                name = f"{path}.{key}" if path else str(key)
                line, col = key_node.start_mark.line + 1, key_node.start_mark.column + 1
                try:
                    earlier = first.get(key)
                    first[key] = (line, col) if earlier is None else earlier
                except TypeError:  # an unhashable key: PyYAML's constructor says so
                    earlier = None
                if earlier is not None:
                    where = f"line {line}" if earlier[0] != line else f"line {line}, column {col}"
                    then = f"line {earlier[0]}" if earlier[0] != line else f"column {earlier[1]}"
                    raise DuplicateKeyError(f"duplicate key {name} on {where} (first on {then}): keep one")
                self._check_keys(value_node, name, seen_nodes)


def safe_load(text: str | bytes) -> Any:
    """`yaml.safe_load` that refuses duplicate keys (`DuplicateKeyError`) and nesting deep enough to
    exhaust the parser's recursion (`TooDeepError`); both are `yaml.YAMLError`."""
    loader = UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:
        raise TooDeepError("nested too deeply to read (thousands of levels)") from None
    finally:
        loader.dispose()
