"""Checks of caller-given arguments by type and range, shared by every boundary that takes
them (the service, the supervisor's control protocol): one message shape, naming the
argument."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cryobox.errors import InvalidArgument


def whole_number(name: str, value: Any, low: int, high: int) -> int:
    """``value`` if it is an int (not a bool) within low..high.

    :raises InvalidArgument: naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name}={value!r}: must be a whole number")
    if not low <= value <= high:
        raise InvalidArgument(f"{name}={value}: must be between {low} and {high}")
    return value


def positive_seconds(name: str, value: Any, at_most: float | None = None) -> float:
    """``value`` as seconds if it is a positive, finite number (not a bool), and not
    above ``at_most`` when given.

    :raises InvalidArgument: naming ``name``.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidArgument(f"{name}={value!r}: must be a positive, finite number of seconds")
    if at_most is not None and value > at_most:
        raise InvalidArgument(f"{name}={value!r}: must be at most {at_most:g} seconds")
    return float(value)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,62}")
#: Bounds of what a sandbox carries from its create (kept in its spec, sent with every
#: command for ``envs``).
#: Half of a protocol header (64 KiB): the rest is for the command and its own variables.
MAX_ENVS_BYTES = 32 * 1024
MAX_LABELS = 64
MAX_LABEL_VALUE = 256


def env_vars(name: str, value: Any) -> dict[str, str]:
    """``value`` as environment variables: names a shell accepts, string values without
    NUL bytes, 32 KiB in all as they are sent (JSON) with every command.

    :raises InvalidArgument: naming ``name`` and the offending variable.
    """
    found = _string_map(name, value)
    for key, text in found.items():
        if not _ENV_NAME.fullmatch(key):
            raise InvalidArgument(
                f"{name}: {key!r} is not a variable name ([A-Za-z_][A-Za-z0-9_]*)"
            )
        if "\0" in text:
            raise InvalidArgument(f"{name}: the value of {key} holds a NUL byte")
    size = len(json.dumps(found).encode())
    if size > MAX_ENVS_BYTES:
        raise InvalidArgument(f"{name}: {size} bytes in all, more than {MAX_ENVS_BYTES}")
    return found


def labels(name: str, value: Any) -> dict[str, str]:
    """``value`` as free-form labels: at most 64, keys of 1-63 letters, digits and
    ``_.:/-``, values of at most 256 characters.

    :raises InvalidArgument: naming ``name`` and the offending label.
    """
    found = _string_map(name, value)
    if len(found) > MAX_LABELS:
        raise InvalidArgument(f"{name}: {len(found)} labels, more than {MAX_LABELS}")
    for key, text in found.items():
        if not _LABEL_KEY.fullmatch(key):
            raise InvalidArgument(
                f"{name}: key {key!r} must be 1-63 letters, digits or _.:/- "
                "(starting with a letter or digit)"
            )
        if len(text) > MAX_LABEL_VALUE or "\0" in text:
            raise InvalidArgument(
                f"{name}: the value of {key} must be at most {MAX_LABEL_VALUE} characters"
            )
    return found


def _string_map(name: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{name}={value!r}: must be a mapping of strings to strings")
    for key, text in value.items():
        if not isinstance(key, str) or not isinstance(text, str):
            raise InvalidArgument(f"{name}: {key!r}={text!r}: keys and values must be strings")
    return dict(value)


def key_values(name: str, items: Sequence[str]) -> dict[str, str]:
    """``K=V`` words (a command line's ``--env``/``--label``) as a mapping.

    :raises InvalidArgument: for a word without ``=``.
    """
    found: dict[str, str] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"{name} {item!r}: write KEY=VALUE")
        found[key] = text
    return found


#: A CA bundle's size, at most (PEM of a few hundred certificates).
MAX_BUNDLE_BYTES = 1 << 20


def read_bundle(source: str | os.PathLike[str]) -> str:
    """PEM text given, or the text of the file named.

    :raises InvalidArgument: when the file cannot be read.
    """
    if isinstance(source, str) and "-----BEGIN" in source:
        return source
    path = Path(source)
    try:
        if path.stat().st_size > MAX_BUNDLE_BYTES:
            raise InvalidArgument(f"ca_bundle={str(path)!r}: larger than {MAX_BUNDLE_BYTES} bytes")
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"ca_bundle={str(path)!r}: cannot be read ({exc})") from None


def text(what: str, value: object) -> str:
    """``value``, which must be a string.

    :raises InvalidArgument: naming ``what`` otherwise.
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"{what}={value!r}: must be a string")
    return value


def guest_path(what: str, value: object) -> str:
    """``value``, an absolute path in a sandbox (a string starting with ``/``, no NUL).

    :raises InvalidArgument: naming ``what`` otherwise (an empty path wrote
        ``./..cryobox-N``; a relative one was taken from the guest agent's own folder).
    """
    if not isinstance(value, str) or not value.startswith("/"):
        raise InvalidArgument(
            f"{what}={value!r}: must be an absolute path in the sandbox (/root/...)"
        )
    if "\0" in value:
        raise InvalidArgument(f"{what}={value!r}: holds a NUL byte")
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def valid_name(name: str) -> bool:
    """Whether ``name`` can name a snapshot, a checkpoint or a template (a template's is a
    file name in the store): not empty, no ``/``, no control characters, no leading
    ``.``."""
    return bool(name) and "/" not in name and not name.startswith(".") and not _CONTROL.search(name)


def snapshot_name(what: str, value: object) -> str:
    """A snapshot's or checkpoint's name: a :func:`valid_name` of at most 200 characters.

    :raises InvalidArgument: naming ``what`` otherwise.
    """
    name = text(what, value)
    if len(name) > 200 or not valid_name(name):
        raise InvalidArgument(
            f"{what}={name!r}: a name is 1 to 200 characters, without '/', control "
            "characters or a leading '.'"
        )
    return name


#: skopeo's transports for a container image on this machine, as ``image=`` takes them
#: (:mod:`cryobox.image.oci`).
IMAGE_TRANSPORTS = ("oci-archive", "docker-archive", "oci")


def container_image(reference: object) -> tuple[str, Path]:
    """``TRANSPORT:PATH`` as ``image=`` takes it.

    :raises InvalidArgument: for another form or transport, or a path that is not there.
    """
    if not isinstance(reference, str):
        raise InvalidArgument(f"image={reference!r}: must be a string such as oci-archive:FILE")
    transport, sep, path = reference.partition(":")
    if not sep or transport not in IMAGE_TRANSPORTS or not path:
        raise InvalidArgument(
            f"image={reference!r}: give oci-archive:FILE, docker-archive:FILE or oci:FOLDER "
            "(an image on this machine; for one in a registry, copy it first, e.g. "
            "`skopeo copy docker://NAME oci-archive:FILE`)"
        )
    where = Path(path).expanduser()
    if not where.exists():
        kind = "folder" if transport == "oci" else "file"
        raise InvalidArgument(f"image={reference!r}: no such {kind}")
    return transport, where.resolve()
