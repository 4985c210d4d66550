"""The one redaction rule: what counts as a secret and how it is hidden, for env names, config keys, server flags
(`--api-key X`) and URLs with credentials. Every message, log line, dry run and plan that shows a value goes through
here. Standard library only."""
from __future__ import annotations

import fnmatch
import functools
import re
from typing import Any, Mapping, Sequence


def abbreviates(arg: str, flags: Sequence[str]) -> str | None:
    """Pure: the one long flag of `flags` that the option `arg` names for argparse (allow_abbrev, the default of
    vLLM's, TRL's and dualrun's parsers): itself, with `_` for `-`, or a unique prefix (`--api-k` is `--api-key`).
    None when it names none or several."""
    if not arg.startswith("--") or len(arg) <= 3:
        return None
    flag = "--" + arg[2:].replace("_", "-")
    if flag in flags:
        return flag
    longer = [f for f in flags if f.startswith(flag)]
    return longer[0] if len(longer) == 1 else None



# The one redaction rule: what counts as a secret and how it is hidden, for env names, config keys, server flags
# (`--api-key X`) and URLs with credentials. Names are split into words (`DB_PASSWD` -> DB, PASSWD; `apiKey` ->
# APIKEY), so `TOKENIZERS_PARALLELISM` or `--max-num-batched-tokens` stay visible.
_SECRET_WORDS = frozenset({"TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASS", "PWD",
                           "PASSPHRASE", "CREDENTIAL", "CREDENTIALS", "CREDS", "APIKEY", "ACCESSKEY", "SECRETKEY",
                           "PRIVATEKEY", "KEY", "AUTHORIZATION", "COOKIE", "SIGNATURE"})
_NOT_SECRET = frozenset({"PWD", "OLDPWD"})        # the shell's working directories
REDACTED = "***"
# Cloud credentials for checkpoint storage: forwarded, never printed, whatever their words (AWS_REGION too).
_CREDENTIAL_NAMES = ("AWS_*", "GOOGLE_APPLICATION_CREDENTIALS")


# Server flags whose value is a secret under any spelling argparse takes, abbreviations included (`--api-k X`):
# vLLM's and TRL's servers' own. A flag name with a secret word (`--hf-token`) is one whatever the server.
SECRET_FLAGS = ("--api-key", "--hf-token", "--ssl-keyfile")


def secret_flag(flag: str) -> bool:
    """Does the option `flag` (`--api-key`, `--api-k`, `--api_key`) take a secret value?"""
    return is_secret(flag) or abbreviates(flag, SECRET_FLAGS) is not None


@functools.lru_cache(maxsize=4096)
def is_secret(name: str) -> bool:
    """Does a variable, config key or flag name (`HF_TOKEN`, `env.DB_PASSWD`, `--api-key`) hold a secret?"""
    last = str(name).rsplit(".", 1)[-1].lstrip("-").upper()
    if last in _NOT_SECRET:
        return False
    if any(fnmatch.fnmatchcase(last, p) for p in _CREDENTIAL_NAMES):
        return True
    return any(word in _SECRET_WORDS for word in re.split(r"[^A-Z0-9]+", last))


# a flag starts a word: without the look-behind every `-` inside `a-b-c-...` started a scan to the end (quadratic)
_FLAG_VALUE = re.compile(r"(?<![A-Za-z0-9_.-])(--?[A-Za-z][A-Za-z0-9_.-]*)([ =]+)([^\s]+)")


def _hide_url_passwords(text: str) -> str:
    """`user:password@` -> `user:***@`, in one pass (a regex scanning back from every position was quadratic: a
    100 KiB value took minutes). The credentials are the run of characters before an `@` up to `/`, a quote,
    whitespace or another `@`; its first `:` ends the user."""
    if "@" not in text or ":" not in text:
        return text
    out: list[str] = []
    done = 0
    at = text.find("@")
    while at >= 0:
        start = at
        while start > done and not (text[start - 1] in "/@'\"" or text[start - 1].isspace()):
            start -= 1
        colon = text.find(":", start, at)
        if 0 <= colon < at - 1:
            out += [text[done:colon + 1], REDACTED]
            done = at
        out.append(text[done:at + 1])
        done = at + 1
        at = text.find("@", done)
    out.append(text[done:])
    return "".join(out)


# `NAME=value` whose NAME is secret-like (`HF_TOKEN=hf_...`, `?password=...` in a URL): an assignment starts a
# word (a flag's `--api-key=X` is _FLAG_VALUE's); its value runs to whitespace, a quote or the next `&`/`;`.
_ASSIGNED = re.compile(r"(?<![A-Za-z0-9_.-])([A-Za-z_][A-Za-z0-9_.-]*)=([^\s&;'\"]+)")


def redact_text(text: str) -> str:
    """`text` with the password of any `scheme://user:password@host`, the value after a secret flag
    (`--api-key X`) and the value of a secret-named `NAME=value` hidden. Linear in the length of `text`."""
    text = _hide_url_passwords(text)
    text = _FLAG_VALUE.sub(lambda m: m.group(1) + m.group(2) + REDACTED if secret_flag(m.group(1)) else m.group(0),
                           text)
    if "=" not in text:
        return text
    return _ASSIGNED.sub(lambda m: f"{m.group(1)}={REDACTED}" if is_secret(m.group(1)) else m.group(0), text)


# What a value shown in an error (not a log line) loses besides: a URL's user (`https://TOKEN@host` is a
# credential as often as a name) and any query string (`host:80?token=...`, `?sig=...`: names of any kind).
_URL_USER = re.compile(r"(://)[^/\s@'\"]+@")
_QUERY = re.compile(r"(?<=[^\s?])\?[^\s'\"]+")


def redact_shown(text: str) -> str:
    """`redact_text` for a user's value shown in an error: URL userinfo and query strings hidden too."""
    text = redact_text(text)
    if "@" in text:
        text = _URL_USER.sub(lambda m: m.group(1) + REDACTED + "@", text)
    return _QUERY.sub("?" + REDACTED, text) if "?" in text else text


def redact_value(name: str, value: str) -> str:
    """A variable's value safe to print: hidden for a secret name; for JSON (DUALRUN_SETTINGS, a roles spec),
    every secret-named key inside hidden; URL passwords and secret flags hidden everywhere."""
    if is_secret(name) and value:
        return REDACTED
    if value[:1] in ("{", "[") and len(value) < 1_000_000:
        import json

        try:
            data = json.loads(value)
        except ValueError:
            return redact_text(value)
        return json.dumps(_redact_tree(data), separators=(",", ":"))
    return redact_text(value)


def _redact_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if is_secret(str(k)) and v not in ("", None) else _redact_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        strings = [a if isinstance(a, str) else "" for a in value]
        return [b if isinstance(a, str) else _redact_tree(a) for a, b in zip(value, redact_argv(strings))]
    return redact_text(value) if isinstance(value, str) else value


def redact(env: Mapping[str, str]) -> dict[str, str]:
    """A copy safe to print: secret-looking names keep their key, lose their value."""
    return {k: redact_value(k, v) for k, v in env.items()}


def _flag_secrets(argv: Sequence[str]) -> dict[int, tuple[str, bool]]:
    """Where the secret flags' values are in a command line: index -> (value, inline) (`--api-key X`: X's index;
    `--api-key=X`: that item's, inline)."""
    found: dict[int, tuple[str, bool]] = {}
    take_next = False
    for i, arg in enumerate(map(str, argv)):
        if take_next and not arg.startswith("--"):
            found[i] = (arg, False)
            take_next = False
            continue
        take_next = False
        flag, eq, value = arg.partition("=")
        if arg.startswith("-") and secret_flag(flag):
            if eq:
                found[i] = (value, True)
            else:
                take_next = True
    return found


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line safe to print: `--api-key X` / `--api-key=X` / `--hf_token X` lose their value."""
    secrets = _flag_secrets(argv)
    out: list[str] = []
    for i, arg in enumerate(map(str, argv)):
        if i not in secrets:
            out.append(redact_text(arg))
        elif secrets[i][1]:
            out.append(f"{arg.partition('=')[0]}={REDACTED}")
        else:
            out.append(REDACTED)
    return out


_MIN_MASKED = 3   # shorter values are masked nowhere: hiding every "ab" would garble every line, and protect nothing


def secret_values(argv: Sequence[str]) -> tuple[str, ...]:
    """The values the secret flags of a command line carry (`--api-key X`, `--api-key=X`): what a program's output
    must not show either, in whatever form it echoes them (vLLM logs its arguments as a dict)."""
    values = {v for v, _ in _flag_secrets(argv).values() if len(v) >= _MIN_MASKED}
    return tuple(sorted(values, key=len, reverse=True))   # the longest first: none is hidden in part by another


def hide_values(text: str, values: Sequence[str]) -> str:
    """`text` with each of `values` (from `secret_values`) replaced by the redaction mark."""
    for value in values:
        if value in text:
            text = text.replace(value, REDACTED)
    return text


# A value that looks like a credential whatever key holds it (a token pasted as a role name, a list item): a
# provider's token prefix, or one long run of mixed-case letters and digits with no word in it.
_TOKEN_PREFIXED = re.compile(r"(?:hf_|gh[pousr]_|github_pat_|glpat-|sk-|sk_(?:live|test)_|xox[abpr]-|AKIA|ASIA|AIza|"
                             r"eyJ)[A-Za-z0-9_\-.]{12,}")
_TOKEN_RUN = re.compile(r"[A-Za-z0-9+/=_\-]{24,}")


def looks_like_token(text: str) -> bool:
    """Is `text` (one word) shaped like a credential? Names (`critic`, `reward_model_v2`) are not."""
    if _TOKEN_PREFIXED.fullmatch(text):
        return True
    return bool(_TOKEN_RUN.fullmatch(text)) and all(re.search(c, text) for c in ("[a-z]", "[A-Z]", "[0-9]"))


def redact_data(value: Any, depth: int = 3) -> Any:
    """A (shortened) copy of a config value safe to show in an error: secret-named mapping keys (and `NAME=value`
    strings), secret flags (and whatever follows one: `[--api-key, [KEY]]`) lose their values, URLs their
    credentials and query strings. Looks at no more than 20 items per level, `depth` levels deep."""
    if isinstance(value, str):
        return REDACTED if looks_like_token(value[:2000]) else redact_shown(value[:2000])
    if depth <= 0:
        return "..." if isinstance(value, (dict, list, tuple)) else value
    if isinstance(value, dict):
        return {redact_shown(k) if isinstance(k, str) else k: (REDACTED if is_secret(str(k)) else
                                                             redact_data(v, depth - 1))
                for k, v in list(value.items())[:20]}
    if isinstance(value, (list, tuple)):
        items = list(value[:20])
        words = [a if isinstance(a, str) else "" for a in items]
        taken = _flag_secrets(words)   # where a secret flag's value is: a non-string there is hidden whole too
        return [redact_shown(b) if isinstance(a, str) else REDACTED if i in taken else redact_data(a, depth - 1)
                for i, (a, b) in enumerate(zip(items, redact_argv(words)))]
    return value


def api_key_of(server_args: Sequence[str]) -> str | None:
    """The `--api-key` a role's `server_args` give (any spelling argparse takes: `--api-key X`, `--api_key=X`,
    `--api-k X`), None without one; the last one given wins, as argparse's."""
    found = None
    args = [str(a) for a in server_args]
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if abbreviates(flag, ("--api-key",)) == "--api-key":
            found = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return found
