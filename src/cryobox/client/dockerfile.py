"""Read a Dockerfile into what a template build does, step by step.

The instructions of one stage are supported: ``FROM cryobox`` (cryobox's own image) or
``FROM <template>``, ``RUN``, ``COPY`` and ``ADD`` (files of the build context; ``ADD``
unpacks a local tar archive as Docker does), ``ENV``, ``ARG``, ``WORKDIR``, ``USER``,
``EXPOSE`` and ``CMD``/``ENTRYPOINT``. Anything else (another instruction, a second
stage, a URL, a flag cryobox does not have) is refused by name before anything runs.

Variables are replaced as Docker does in ``COPY``, ``ADD``, ``ENV``, ``WORKDIR``,
``USER``, ``EXPOSE`` and ``FROM`` (``$NAME``, ``${NAME}``, ``${NAME:-default}``,
``${NAME:+other}``); ``RUN`` gets them in its environment and its shell expands them.

Each step that changes the disk (``RUN``, ``COPY``/``ADD``, ``WORKDIR``) has a cache
key: a digest of the key before it and of everything that decides its result (the
instruction, the environment, user and folder it runs with, the bytes and modes of the
files it copies). A rebuild reuses the longest run of steps whose keys are unchanged.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shlex
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from cryobox.errors import InvalidArgument
from cryobox.guest.protocol import DEFAULT_PATH

#: ``FROM`` this: cryobox's own image, booted; any other name is a template.
OWN_IMAGE = "cryobox"
SUPPORTED = ("FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "EXPOSE", "CMD")
SUPPORTED_ALL = (*SUPPORTED, "ENTRYPOINT")
#: Archives ``ADD`` unpacks (by name, as Docker decides by content; close enough for
#: local files).
_ARCHIVES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
_VARIABLE = re.compile(r"\\\$|\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")


@dataclass(frozen=True)
class Instruction:
    """One instruction as written: its keyword (upper case), its arguments, its line."""

    keyword: str
    arguments: str
    line: int

    def refuse(self, why: str) -> InvalidArgument:
        return InvalidArgument(f"Dockerfile line {self.line}: {self.keyword} {why}")


@dataclass(frozen=True)
class Settings:
    """What a command runs with at a point of the build (and in the template's
    sandboxes, at its end). None: what the base has (its template's defaults, or the
    image's: root in root's home)."""

    env: tuple[tuple[str, str], ...] = ()
    user: str | None = None
    workdir: str | None = None


@dataclass(frozen=True)
class Step:
    """A step that changes the disk, and its cache key. ``kind``: ``run`` (``argv``
    or ``shell``), ``copy`` (``files``: host path -> guest path; ``archive``: unpack
    into ``target``) or ``mkdir`` (``target``)."""

    kind: str
    text: str
    line: int
    key: str
    settings: Settings
    shell: str | None = None
    argv: tuple[str, ...] = ()
    files: tuple[tuple[Path, str], ...] = ()
    archive: Path | None = None
    target: str = ""
    chown: str | None = None
    #: What a copy step's files were when the Dockerfile was read (its cache key has
    #: it): the files sent must still be these.
    digest: str = ""


@dataclass(frozen=True)
class Plan:
    """A Dockerfile, read: where it starts, its steps, and what its sandboxes get."""

    context: Path
    base: str
    steps: tuple[Step, ...]
    settings: Settings
    ports: tuple[int, ...] = ()
    #: The process every sandbox of the template has running (CMD/ENTRYPOINT), as argv.
    command: tuple[str, ...] = ()
    #: Build arguments given but never declared by an ARG (Docker warns of them too).
    unused_args: tuple[str, ...] = field(default=())


def instructions(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile: comments dropped, continued lines joined."""
    found: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction is dropped, as Docker does
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        pending.append(line)
        whole = " ".join(part.strip() for part in pending if part.strip())
        pending = []
        keyword, _, arguments = whole.partition(" ")
        found.append(Instruction(keyword.upper(), arguments.strip(), start))
    if pending:
        raise InvalidArgument(f"Dockerfile line {start}: the last instruction ends with '\\'")
    return found


def substitute(text: str, variables: Mapping[str, str]) -> str:
    """``text`` with ``$NAME``, ``${NAME}``, ``${NAME:-default}`` and ``${NAME:+other}``
    replaced (an unknown name is empty); ``\\$`` is a plain ``$``."""

    def value(match: re.Match[str]) -> str:
        if match.group(0) == "\\$":
            return "$"
        found = variables.get(match.group(1) or match.group(4), "")
        if match.group(2) == "-":
            return found or match.group(3)
        if match.group(2) == "+":
            return match.group(3) if found else ""
        return found

    return _VARIABLE.sub(value, text)


def _exec_form(instruction: Instruction) -> tuple[str, ...] | None:
    """The JSON array form's strings, or None for the shell form."""
    if not instruction.arguments.startswith("["):
        return None
    try:
        value = json.loads(instruction.arguments)
    except json.JSONDecodeError:
        return None  # Docker runs it as a shell command then
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise instruction.refuse("needs a JSON array of strings")
    return tuple(value)


def _flags(instruction: Instruction, allowed: tuple[str, ...]) -> tuple[dict[str, str], str]:
    """The ``--name=value`` options in front of the arguments, and the rest.

    :raises InvalidArgument: for an option cryobox does not have, by name.
    """
    options: dict[str, str] = {}
    rest = instruction.arguments
    while rest.startswith("--"):
        option, _, rest = rest.partition(" ")
        name, _, value = option[2:].partition("=")
        if name not in allowed:
            raise instruction.refuse(f"--{name} is not supported")
        options[name] = value
        rest = rest.strip()
    return options, rest


def _pairs(instruction: Instruction, variables: Mapping[str, str]) -> list[tuple[str, str]]:
    """``ENV`` and ``ARG``'s ``NAME=value`` pairs (``ENV NAME value`` too)."""
    words = _words(instruction, instruction.arguments)
    if not words:
        raise instruction.refuse("needs NAME=value")
    if instruction.keyword == "ENV" and "=" not in words[0]:
        # The old form, ENV NAME the rest: its quotes go, as Docker's do.
        if not re.fullmatch(r"[A-Za-z_]\w*", words[0]):
            raise instruction.refuse(f"{words[0]!r}: not a variable name")
        return [(words[0], substitute(" ".join(words[1:]), variables))]
    pairs = []
    for word in words:
        name, equals, value = word.partition("=")
        if not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise instruction.refuse(f"{word!r}: not NAME=value")
        if instruction.keyword == "ENV" and not equals:
            raise instruction.refuse(f"{word!r}: not NAME=value")
        pairs.append((name, substitute(value, variables) if equals else "\0unset"))
    return pairs


def _words(instruction: Instruction, text: str) -> list[str]:
    """Shell-like words of ``text``.

    :raises InvalidArgument: for an unbalanced quote, naming the line.
    """
    try:
        return shlex.split(text, posix=True)
    except ValueError as exc:
        raise instruction.refuse(f"cannot be read: {exc}") from None


def _matches(relative: str, pattern: PurePosixPath) -> bool:
    """Whether a context path matches a COPY pattern as Docker's does: part by part, so
    that ``*`` never crosses a ``/``."""
    parts = PurePosixPath(relative).parts
    return len(parts) == len(pattern.parts) and all(
        fnmatch.fnmatchcase(part, wanted) for part, wanted in zip(parts, pattern.parts, strict=True)
    )


def _glob(parts: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Whether path parts match pattern parts, ``**`` standing for any number of parts."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return (
        bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob(parts[1:], pattern[1:])
    )


def ignore_rules(context: Path) -> list[tuple[bool, tuple[str, ...]]]:
    """The context's ``.dockerignore``: (re-included?, pattern parts) in order."""
    try:
        text = (context / ".dockerignore").read_text()
    except (FileNotFoundError, NotADirectoryError):
        return []
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = PurePosixPath(line.lstrip("!").strip().strip("/"))
        if pattern.parts:
            rules.append((keep, pattern.parts))
    return rules


def ignored(relative: str, rules: list[tuple[bool, tuple[str, ...]]]) -> bool:
    """Whether ``.dockerignore`` leaves a context path out (a folder left out takes what
    it holds; the last rule that matches decides, as Docker's)."""
    parts = PurePosixPath(relative).parts
    result = False
    for keep, pattern in rules:
        if any(_glob(parts[:end], pattern) for end in range(1, len(parts) + 1)):
            result = not keep
    return result


def _inside(
    context: Path, pattern: str, instruction: Instruction, rules: list[tuple[bool, tuple[str, ...]]]
) -> list[Path]:
    """The context's files and folders a ``COPY`` source names (globs allowed), those
    ``.dockerignore`` leaves out aside.

    :raises InvalidArgument: for a source outside the context, or one that matches
        nothing.
    """
    relative = PurePosixPath(pattern.lstrip("/"))
    if ".." in relative.parts:
        raise instruction.refuse(f"{pattern}: outside the build context")
    if any(char in pattern for char in "*?["):
        found = sorted(
            path
            for path in context.rglob("*")
            if _matches(path.relative_to(context).as_posix(), relative)
        )
    else:
        found = [context / relative] if (context / relative).exists() else []
    found = [path for path in found if not ignored(path.relative_to(context).as_posix(), rules)]
    resolved_context = context.resolve()
    for path in found:
        if not path.resolve().is_relative_to(resolved_context):
            raise instruction.refuse(f"{pattern}: leads outside the build context")
    if not found:
        raise instruction.refuse(f"{pattern}: no such file in the build context {context}")
    return found


def _copies(
    sources: list[Path],
    target: str,
    instruction: Instruction,
    context: Path,
    rules: list[tuple[bool, tuple[str, ...]]],
) -> list[tuple[Path, str]]:
    """Host file -> guest path for every file a ``COPY`` moves, as Docker places them:
    a folder's contents go into the target; files into it when it ends with ``/`` or
    there are several, else onto it."""
    into_folder = target.endswith("/") or len(sources) > 1 or sources[0].is_dir()
    if len(sources) > 1 and not target.endswith("/"):
        raise instruction.refuse("several sources need a folder as target (end it with '/')")
    placed: list[tuple[Path, str]] = []
    for source in sources:
        if source.is_dir():
            for path in sorted(source.rglob("*")):
                if ignored(path.relative_to(context).as_posix(), rules):
                    continue
                if path.is_symlink() or not (path.is_file() or path.is_dir()):
                    raise instruction.refuse(f"{path}: only files and folders are copied")
                guest = PurePosixPath(target) / path.relative_to(source).as_posix()
                placed.append((path, str(guest)))
        elif source.is_file() and not source.is_symlink():
            guest = PurePosixPath(target) / source.name if into_folder else PurePosixPath(target)
            placed.append((source, str(guest)))
        else:
            raise instruction.refuse(f"{source}: only files and folders are copied")
    return placed


def _digest(parts: list[str | bytes]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


def read_copied(host: Path, context: Path) -> tuple[int, bytes | None]:
    """A context file's mode and bytes (None for a folder), read without following a
    link, from where it really is inside ``context``.

    :raises InvalidArgument: when it now leads outside the context (a folder on its
        path swapped for a link meanwhile) or is no longer a file or folder.
    """
    if not Path(os.path.realpath(host)).is_relative_to(context.resolve()):
        raise InvalidArgument(f"{host}: leads outside the build context")
    try:
        # No link followed, and no wait on a FIFO planted in the context.
        fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidArgument(f"{host}: cannot be read ({exc.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            return st.st_mode, None
        raise InvalidArgument(f"{host}: only files and folders are copied")
    with os.fdopen(fd, "rb") as file:
        return st.st_mode, file.read()


def copied_digest(copied: list[tuple[str, int, bytes | None]]) -> str:
    """The digest of what a COPY moves: (guest path, mode, bytes or None for a folder)."""
    parts: list[str | bytes] = []
    for guest, mode, data in copied:
        parts += [guest, oct(mode), b"<dir>" if data is None else data]
    return _digest(parts)


def files_digest(
    files: list[tuple[Path, str]] | tuple[tuple[Path, str], ...], context: Path
) -> str:
    """The digest of the context files a COPY moves, read now."""
    return copied_digest([(guest, *read_copied(host, context)) for host, guest in files])


def plan(text: str, context: Path, build_args: Mapping[str, str] | None = None) -> Plan:
    """Read a Dockerfile whose files come from ``context``.

    :raises InvalidArgument: naming the line and what is wrong or not supported.
    """
    given = dict(build_args or {})
    rules = ignore_rules(context)
    declared: dict[str, str] = {}
    env: dict[str, str] = {}
    user: str | None = None
    workdir: str | None = None
    base: str | None = None
    steps: list[Step] = []
    ports: list[int] = []
    cmd: tuple[str, ...] | str | None = None
    entrypoint: tuple[str, ...] | str | None = None
    key = ""
    consumed: set[str] = set()

    def variables() -> dict[str, str]:
        # What $NAME finds: a command's PATH in the guest too (ENV PATH=/x:$PATH).
        return {"PATH": DEFAULT_PATH, **declared, **env}

    def settings(with_args: bool = True) -> Settings:
        """The settings now; a step's environment has the ARGs too (as Docker's RUN
        has), the template's only what ENV set."""
        variables = {**declared, **env} if with_args else env
        return Settings(tuple(sorted(variables.items())), user, workdir)

    def add(kind: str, instruction: Instruction, extra: list[str | bytes], **fields: Any) -> None:
        nonlocal key
        state = settings()
        key = _digest([key, kind, instruction.keyword, instruction.arguments, repr(state), *extra])
        text = f"{instruction.keyword} {instruction.arguments}"
        steps.append(Step(kind, text, instruction.line, key, state, **fields))

    for instruction in instructions(text):
        word = instruction.keyword
        if word not in SUPPORTED_ALL:
            raise instruction.refuse(
                f"is not supported (cryobox builds from {', '.join(SUPPORTED_ALL)})"
            )
        if base is None and word not in ("FROM", "ARG"):
            raise instruction.refuse("comes before FROM")
        if word == "FROM":
            if base is not None:
                raise instruction.refuse("again: multi-stage builds are not supported")
            _, rest = _flags(instruction, ())
            words = substitute(rest, declared).split()
            if len(words) != 1:
                raise instruction.refuse("takes one name (FROM ... AS is not supported)")
            base = words[0]
            if base != OWN_IMAGE and (":" in base or "/" in base):
                raise instruction.refuse(
                    f"{base}: not a template (container images come with --image)"
                )
            key = _digest(["FROM", base])
            declared = {}  # an ARG before FROM is for FROM only, as in Docker
        elif word == "ARG":
            for name, value in _pairs(instruction, variables()):
                declared[name] = given.get(name, "" if value == "\0unset" else value)
                consumed.add(name)
        elif word == "ENV":
            env.update(_pairs(instruction, variables()))
        elif word == "WORKDIR":
            path = substitute(instruction.arguments, variables()).strip()
            if not path:
                raise instruction.refuse("needs a folder")
            workdir = str(PurePosixPath(workdir or "/") / path)
            add("mkdir", instruction, [workdir], target=workdir)
        elif word == "USER":
            name = substitute(instruction.arguments, variables()).strip()
            if not re.fullmatch(r"[a-z_][a-z0-9_-]*", name):
                raise instruction.refuse(f"{name!r}: a user's name (no uid or group)")
            user = name
        elif word == "EXPOSE":
            for item in substitute(instruction.arguments, variables()).split():
                number, _, protocol = item.partition("/")
                if protocol not in ("", "tcp") or not number.isdigit():
                    raise instruction.refuse(f"{item}: TCP port numbers only")
                if not 1 <= int(number) <= 65535:
                    raise instruction.refuse(f"{item}: not a port number")
                ports.append(int(number))
        elif word in ("CMD", "ENTRYPOINT"):
            form: tuple[str, ...] | str = _exec_form(instruction) or instruction.arguments
            if not form:
                raise instruction.refuse("needs a command")
            if word == "CMD":
                cmd = form
            else:
                entrypoint = form
        elif word == "RUN":
            _, rest = _flags(instruction, ())
            argv = _exec_form(instruction)
            if argv is not None:
                add("run", instruction, [], argv=argv)
            elif rest:
                add("run", instruction, [], shell=rest)
            else:
                raise instruction.refuse("needs a command")
        else:  # COPY, ADD
            options, rest = _flags(instruction, ("chown",))
            form_words = _exec_form(Instruction(word, rest, instruction.line))
            words = list(form_words or _words(instruction, rest))
            words = [substitute(w, variables()) for w in words]
            if len(words) < 2:
                raise instruction.refuse("needs a source and a target")
            *patterns, target = words
            if any(re.match(r"^[a-z]+://|^git@", p) for p in patterns):
                raise instruction.refuse("from a URL is not supported (local files only)")
            if not target.startswith("/"):
                target = str(PurePosixPath(workdir or "/") / target) + (
                    "/" if target.endswith("/") else ""
                )
            chown = options.get("chown") or None
            sources = [found for p in patterns for found in _inside(context, p, instruction, rules)]
            if word == "ADD" and len(sources) == 1 and sources[0].name.endswith(_ARCHIVES):
                digest = files_digest([(sources[0], target)], context)
                add(
                    "copy",
                    instruction,
                    [digest],
                    archive=sources[0],
                    target=target,
                    chown=chown,
                    digest=digest,
                )
            else:
                files = _copies(sources, target, instruction, context, rules)
                digest = files_digest(files, context)
                add(
                    "copy",
                    instruction,
                    [digest],
                    files=tuple(files),
                    target=target,
                    chown=chown,
                    digest=digest,
                )
    if base is None:
        raise InvalidArgument("Dockerfile: no FROM (FROM cryobox, or FROM a template's name)")
    return Plan(
        context=context,
        base=base,
        steps=tuple(steps),
        settings=settings(with_args=False),
        ports=tuple(dict.fromkeys(ports)),
        command=_command(entrypoint, cmd),
        unused_args=tuple(sorted(set(given) - consumed)),
    )


def _command(
    entrypoint: tuple[str, ...] | str | None, cmd: tuple[str, ...] | str | None
) -> tuple[str, ...]:
    """The argv ENTRYPOINT and CMD make together, as Docker combines them."""

    def argv(form: tuple[str, ...] | str | None) -> tuple[str, ...]:
        if form is None:
            return ()
        return ("/bin/sh", "-c", form) if isinstance(form, str) else form

    if isinstance(entrypoint, str):
        return argv(entrypoint)  # a shell-form ENTRYPOINT ignores CMD
    if entrypoint is not None:
        return (*entrypoint, *(cmd if isinstance(cmd, tuple) else argv(cmd)))
    return argv(cmd)


def defaults_json(plan: Plan, inherited: Mapping[str, object] | None = None) -> str:
    """The guest's command defaults file for the template's sandboxes (see
    :data:`cryobox.guest.protocol.COMMAND_DEFAULTS`): the environment, user and folder
    every command starts with unless it names its own; this Dockerfile's ENV, USER and
    WORKDIR over those its base template had (``inherited``)."""
    base = dict(inherited or {})
    env = base.get("env")
    inherited_env = {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}
    merged: dict[str, object] = {"env": {**inherited_env, **dict(plan.settings.env)}}
    for name, value in (("user", plan.settings.user), ("workdir", plan.settings.workdir)):
        if value or isinstance(base.get(name), str):
            merged[name] = value or base[name]
    return json.dumps(merged)
