"""Traffic profiles as data: `profiles/<name>.toml` files (or any TOML path) loaded into a frozen `Profile`.

A profile says *what traffic looks like* (users, think time, streaming, prompt mix, output length);
the command line says *where it goes* (URL, model, protocol) and may shorten it for CI
(`--users`, `--duration`, `--max-tokens`). Unknown keys and bad values are refused with a message
that names the file, the field and the accepted values, before any load is sent.

Example (`profiles/chat.toml`)::

    name = "chat"
    users = 4
    spawn_rate = 4.0
    duration = 60          # seconds, and at least min_requests completed requests (hard ceiling max_duration)
    min_requests = 10
    stream = true
    max_tokens = 128
    prompt_set = { chat = 3, code = 1 }
    wait_time = [0.5, 2.0]
    temperature = 0.0
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specbuild.core.errors import UsageError

PROFILE_DIR = Path(__file__).parent / "profiles"
PROMPT_SETS = ("chat", "code", "summarize")


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


@dataclass(frozen=True)
class Profile:
    """One traffic profile. Durations in seconds, wait_time as a uniform [min, max] think time."""

    name: str
    users: int                           # concurrent simulated users (closed loop, one request in flight each)
    duration: float                      # seconds of load per setting (at least: see min_requests)
    stream: bool                         # True: /generate_stream (SSE) or gRPC streaming; False: /generate
    max_tokens: int                      # output tokens asked for per request
    prompt_set: dict[str, int]           # prompt set name -> weight
    spawn_rate: float = 0.0              # users started per second (0 = all at once)
    wait_time: tuple[float, float] = (0.0, 0.0)
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    max_input_tokens: int = 512          # prompts are cut to this many tokens of the target's tokenizer
    chat_template: bool = True           # wrap each prompt as a user turn in the target's chat template
    fixed_output: bool = False           # send min_tokens = max_tokens: every request generates max_tokens
    return_perf_metrics: bool = True     # ask for acceptance_rate / accepted / drafted per response
    exclude_input_in_output: bool = True
    min_requests: int = 10               # a run goes on past `duration` until this many requests completed...
    max_duration: float | None = None    # ...up to this hard ceiling (None: max(4 x duration, duration + 60))
    request_rate: float | None = None    # open loop: Poisson arrivals per second (None: closed loop, `users`)
    description: str = ""
    source: str = field(default="", compare=False)   # where it was loaded from (for messages)

    def __post_init__(self):
        where = f"profile {self.name!r}" + (f" ({self.source})" if self.source else "")
        _check(self.users >= 1, where, "users", self.users, "an integer >= 1")
        _check(self.duration > 0, where, "duration", self.duration, "seconds > 0")
        _check(self.max_tokens >= 1, where, "max_tokens", self.max_tokens, "an integer >= 1")
        _check(self.max_input_tokens >= 1, where, "max_input_tokens", self.max_input_tokens, "an integer >= 1")
        _check(self.spawn_rate >= 0, where, "spawn_rate", self.spawn_rate, "users per second >= 0")
        _check(self.min_requests >= 1, where, "min_requests", self.min_requests, "an integer >= 1")
        _check(self.max_duration is None or self.max_duration >= self.duration, where, "max_duration",
               self.max_duration, f"seconds >= duration ({self.duration:g})")
        _check(self.request_rate is None or self.request_rate > 0, where, "request_rate", self.request_rate,
               "requests per second > 0 (or leave it out: a closed loop of `users`)")
        _check(self.temperature >= 0, where, "temperature", self.temperature, "a float >= 0")
        _check(self.top_k is None or self.top_k >= 0, where, "top_k", self.top_k, "an integer >= 0")
        _check(self.top_p is None or 0 < self.top_p <= 1, where, "top_p", self.top_p, "a float in (0, 1]")
        lo, hi = self.wait_time
        _check(0 <= lo <= hi, where, "wait_time", list(self.wait_time), "[min, max] seconds with 0 <= min <= max")
        _check(bool(self.prompt_set), where, "prompt_set", self.prompt_set, f"one of {PROMPT_SETS}")
        for name, weight in self.prompt_set.items():
            _check(name in PROMPT_SETS, where, "prompt_set", name, f"one of {PROMPT_SETS}")
            _check(weight >= 1, where, f"prompt_set.{name}", weight, "an integer weight >= 1")

    @property
    def effective_spawn_rate(self) -> float:
        return self.spawn_rate or float(self.users)

    @property
    def ceiling(self) -> float:
        """The hard ceiling of one run in seconds: a setting that has not completed `min_requests` by then
        is "too slow to measure here"."""
        return self.max_duration if self.max_duration is not None else max(4 * self.duration, self.duration + 60)

    def with_overrides(self, *, users: int | None = None, duration: float | None = None,
                       max_tokens: int | None = None, max_input_tokens: int | None = None,
                       min_requests: int | None = None, max_duration: float | None = None,
                       request_rate: float | None = None) -> "Profile":
        """CLI overrides for short runs (`--users`, `--duration`, `--max-tokens`, `--max-input-tokens`,
        `--min-requests`, `--max-duration`, `--request-rate`) and sweep points; validated like the file."""
        changes = {k: v for k, v in (("users", users), ("duration", duration), ("max_tokens", max_tokens),
                                     ("max_input_tokens", max_input_tokens), ("min_requests", min_requests),
                                     ("max_duration", max_duration), ("request_rate", request_rate))
                   if v is not None}
        if "duration" in changes and "max_duration" not in changes and self.max_duration is not None \
                and self.max_duration < changes["duration"]:
            changes["max_duration"] = None   # the file's ceiling is below the new duration: the default one
        if "users" in changes and self.spawn_rate > changes["users"]:
            changes["spawn_rate"] = float(changes["users"])
        return dataclasses.replace(self, **changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["wait_time"] = list(self.wait_time)
        d.pop("source")
        return d


def _check(ok: bool, where: str, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise UsageError(f"{where}: invalid {key} = {value!r}; expected {expected}. Fix the profile file.")


# field name -> accepted Python types (TOML gives int/float/bool/str/list/dict)
_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "description": (str,), "users": (int,), "duration": (int, float), "stream": (bool,),
    "max_tokens": (int,), "prompt_set": (str, dict), "spawn_rate": (int, float), "wait_time": (list, int, float),
    "temperature": (int, float), "top_k": (int,), "top_p": (int, float), "seed": (int,),
    "max_input_tokens": (int,), "return_perf_metrics": (bool,), "exclude_input_in_output": (bool,),
    "chat_template": (bool,), "fixed_output": (bool,), "min_requests": (int,), "max_duration": (int, float),
    "request_rate": (int, float),
}
_REQUIRED = ("users", "duration", "stream", "max_tokens", "prompt_set")


def profile_from_dict(data: dict[str, Any], *, name: str, source: str = "") -> Profile:
    """Validate a parsed TOML table into a Profile; every problem names the field and the fix."""
    where = f"profile {name!r}" + (f" ({source})" if source else "")
    unknown = sorted(set(data) - set(_TYPES))
    if unknown:
        raise UsageError(f"{where}: unknown field(s) {unknown}; known fields: {sorted(_TYPES)}.")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise UsageError(f"{where}: missing required field(s) {missing}.")
    values: dict[str, Any] = {}
    for key, value in data.items():
        types = _TYPES[key]
        # bool is an int subclass in Python: `users = true` must not pass as 1.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            expected = " or ".join(t.__name__ for t in types)
            raise UsageError(f"{where}: field {key!r} = {value!r} has type {type(value).__name__}, "
                             f"expected {expected}.")
        values[key] = value
    prompt_set = values["prompt_set"]
    if isinstance(prompt_set, str):
        prompt_set = {prompt_set: 1}
    for k, w in prompt_set.items():
        if not isinstance(w, int) or isinstance(w, bool):
            raise UsageError(f"{where}: prompt_set.{k} = {w!r} must be an integer weight.")
    values["prompt_set"] = dict(prompt_set)
    wait = values.get("wait_time", [0.0, 0.0])
    if not isinstance(wait, list):
        wait = [wait, wait]
    if len(wait) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in wait):
        raise UsageError(f"{where}: wait_time = {wait!r} must be [min, max] in seconds, e.g. [0.5, 2.0].")
    values["wait_time"] = (float(wait[0]), float(wait[1]))
    for key in ("duration", "spawn_rate", "temperature", "top_p", "max_duration", "request_rate"):
        if key in values:
            values[key] = float(values[key])
    values.setdefault("name", name)
    return Profile(**values, source=source)


def load_profile(name_or_path: str | Path) -> Profile:
    """A built-in profile by name (`chat`, `batch`) or a TOML file by path."""
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith(".toml") or path.is_file()):
        path = PROFILE_DIR / f"{text}.toml"
        if not path.is_file():
            raise UsageError(f"unknown profile {text!r}; built-in profiles: {builtin_profiles()}, "
                             "or pass the path of a .toml profile file.")
    if not path.is_file():
        raise UsageError(f"profile file {path} does not exist; built-in profiles: {builtin_profiles()}.")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"profile file {path} is not valid TOML: {e}") from e
    return profile_from_dict(data, name=data.get("name", path.stem) if isinstance(data.get("name"), str)
                             else path.stem, source=str(path))


def load_profiles(names, **overrides) -> list[Profile]:
    """Each named profile with the CLI overrides (`Profile.with_overrides`); names must not repeat."""
    profiles = [load_profile(p).with_overrides(**overrides) for p in names]
    if len({p.name for p in profiles}) != len(profiles):
        raise UsageError(f"profiles {[p.name for p in profiles]} repeat a name; give each profile once.")
    return profiles
