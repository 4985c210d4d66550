"""Reading a config file without trusting it: a regular file of sane size, YAML of bounded depth and expansion.

Why each bound: a FIFO or `/dev/zero` given as the config would block or fill memory; a 50 MB JSON file would
take half a minute to parse; a few hundred bytes of nested aliases expand to 10^8 values (any later walk of the
data would hang) and thousands of nesting levels raise RecursionError. A key written twice in one mapping is an
error too, since YAML would silently keep the last one.
"""
from __future__ import annotations

import os
import stat
from typing import Any

from dualrun.config import schema
from dualrun.contract.errors import ConfigError, Said, cut, escaped, type_words

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def read_text(path: str) -> str:
    """The file's text, read only when it is a regular UTF-8 file of at most MAX_CONFIG_BYTES."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(path, "config_file", "an existing file", "no such file") from None
    except (OSError, ValueError) as e:
        raise ConfigError(path, "config_file", "a readable file", type(e).__name__) from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(path, "config_file", "a YAML file", "a directory")
    if not stat.S_ISREG(st.st_mode):
        kind = next((word for test, word in _KINDS if test(st.st_mode)), "not a regular file")
        raise ConfigError(path, "config_file", "a regular YAML file", kind)
    limit = schema.MAX_CONFIG_BYTES
    too_big = f"at most {limit // 1024} KiB (a config, not data)"
    if st.st_size > limit:
        raise ConfigError(path, "config_file", too_big, f"{st.st_size} bytes")
    try:   # non-blocking, and checked again once open: a file swapped for a FIFO meanwhile cannot block us
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(path, "config_file", "a regular YAML file", "not a regular file")
            data = f.read(limit + 1)   # bounded even when the size on disk lies (/proc files)
        if len(data) > limit:
            raise ConfigError(path, "config_file", too_big, f"more than {limit} bytes")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(path, "config_file", "a readable UTF-8 YAML file", type(e).__name__) from None


def _loader():
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # libyaml: 60000 list items in 0.1 s, not 8 s


def _check_depth(source: str, text: str) -> None:
    """Nesting as written, from the parser's events (libyaml's parser does not recurse; its composer does, so
    this runs first)."""
    import yaml

    depth = 0
    for event in yaml.parse(text, Loader=_loader()):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > schema.MAX_YAML_DEPTH:
                raise ConfigError(source, "<yaml>", f"at most {schema.MAX_YAML_DEPTH} levels of nesting",
                                  Said(f"more at line {event.start_mark.line + 1}"))
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _check_nodes(source: str, root: Any) -> None:
    """Bound the document as it would expand (aliases counted each time they are used), in one pass over the
    distinct nodes; name a key written twice in one mapping with both lines."""
    import yaml

    sizes: dict[int, tuple[int, int]] = {}   # id(node) -> (expanded node count, expanded depth)

    def walk(node: Any, path: str, level: int) -> tuple[int, int]:
        got = sizes.get(id(node))
        if got is not None:
            return got
        if level > schema.MAX_YAML_DEPTH:
            raise ConfigError(source, path or "<yaml>", f"at most {schema.MAX_YAML_DEPTH} levels of nesting once "
                              "aliases are expanded", Said(f"more than {schema.MAX_YAML_DEPTH}"))
        sizes[id(node)] = (1, 1)   # a node met again while walking it (a recursive alias) counts once
        count, depth = 1, 0
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    line = key.start_mark.line + 1
                    first = seen.get((key.tag, key.value))
                    if first is not None:
                        where = f"{path}.{name}" if path else name
                        lines = f"lines {first} and {line}" if first != line else f"line {line}"
                        raise ConfigError(source, where, "each key once per mapping", Said(f"the key twice, {lines}"))
                    seen[(key.tag, key.value)] = line
                for child, child_path in ((key, path), (value, f"{path}.{name}" if path else name)):
                    c, d = walk(child, child_path, level + 1)
                    count, depth = count + c, max(depth, d)
        elif isinstance(node, yaml.SequenceNode):
            for i, child in enumerate(node.value):
                c, d = walk(child, f"{path}[{i}]", level + 1)
                count, depth = count + c, max(depth, d)
        if count > schema.MAX_YAML_NODES:
            raise ConfigError(source, path or "<yaml>", f"at most {schema.MAX_YAML_NODES} values once aliases are "
                              "expanded (a config, not data)", Said(f"more than {schema.MAX_YAML_NODES}"))
        if depth + 1 > schema.MAX_YAML_DEPTH:
            raise ConfigError(source, path or "<yaml>", f"at most {schema.MAX_YAML_DEPTH} levels of nesting once "
                              "aliases are expanded", Said(f"{depth + 1} levels"))
        sizes[id(node)] = (count, depth + 1)
        return count, depth + 1

    walk(root, "", 1)


def parse(source: str, text: str) -> Any:
    """The YAML document in `text`, or a one-line ConfigError (syntax, depth, expansion, duplicate keys)."""
    import yaml

    loader = None
    try:
        _check_depth(source, text)
        loader = _loader()(text)
        root = loader.get_single_node()
        if root is None:
            return None
        _check_nodes(source, root)
        return loader.construct_document(root)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = (f"line {mark.line + 1}, column {mark.column + 1}" if mark else
                 f"character {e.position + 1}" if isinstance(getattr(e, "position", None), int) else "unknown position")
        problem = str(getattr(e, "problem", None) or getattr(e, "reason", None) or "syntax error")
        # the position is what the user needs most: the problem is cut short, never the line and column
        raise ConfigError(source, "<yaml>", "valid YAML", Said(f"{cut(escaped(problem), 80)} at {where}")) from None
    except RecursionError:
        raise ConfigError(source, "<yaml>", f"at most {schema.MAX_YAML_DEPTH} levels of nesting",
                          Said("too deep to read")) from None
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml(path: str) -> dict[str, Any]:
    """The file's top-level mapping, or a one-line ConfigError (missing, not a regular file, too big, not YAML,
    empty, not a mapping)."""
    data = parse(path, read_text(path))
    if data is None:
        raise ConfigError(path, "<top level>", "a mapping of keys to values", "an empty file",
                          "omit --config_file for the defaults")
    if not isinstance(data, dict):
        raise ConfigError(path, "<top level>", "a mapping of keys to values", Said(type_words(data)))
    return data
