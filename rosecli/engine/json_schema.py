"""What of a JSON schema structured output can enforce: a schema is refused (a `RequestError` naming the keyword
and where it is) rather than half-obeyed, and rewritten where an equivalent form is enforced.

The grammar library (xgrammar) compiles a schema into a grammar, and some of the schema's meaning does not survive.
Each case below was found by sampling random-weight outputs under the schema and validating them with
``jsonschema`` (docs/structured-output.md, "Schemas the grammar cannot enforce"):

- keywords it has no grammar for (`UNSUPPORTED`; ``uniqueItems``; ``multipleOf`` outside integers): refused;
- ``anyOf`` / ``oneOf`` / ``allOf`` beside constraining keywords: the siblings are dropped, so refused (annotations
  such as ``title`` or ``default`` are fine);
- ``allOf`` of more than one schema: dropped entirely, so refused;
- ``oneOf`` is enforced as ``anyOf``: refused unless its alternatives cannot overlap (different types, a required
  property with different ``const`` / ``enum`` values, or one requiring a property the other forbids);
- ``minLength`` / ``maxLength`` beside ``pattern``: the lengths are dropped, so refused;
- ``minProperties`` more than one above the required properties where keys come from ``patternProperties`` or
  ``additionalProperties``: a key can repeat, so refused;
- ``enum`` / ``const`` values not of the schema's ``type``: written anyway. Rewritten without them (an instance
  must satisfy both); refused where none is left;
- ``items`` as a list (drafts 4-7): refused by the compiler. Rewritten as ``prefixItems`` (and ``additionalItems``
  as ``items``), the same in the 2020-12 form;
- a ``required`` property missing from ``properties``: not enforced. Rewritten: it is added to ``properties`` (with
  the ``additionalProperties`` schema, or any value), which means the same; refused where ``additionalProperties``
  is false (no output can satisfy it) or ``patternProperties`` may govern it.

`embed` places a schema inside another (a tool's parameters in a list of calls), its local ``$ref`` s rewritten.
"""

from __future__ import annotations

from typing import Any, Optional

from rosecli.engine.errors import RequestError

UNSUPPORTED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
               "minContains", "maxContains")
# keywords that constrain nothing: allowed beside anyOf / oneOf / allOf
ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$id", "$schema", "$anchor", "discriminator", "$defs", "definitions"))
COMBINATORS = ("anyOf", "oneOf", "allOf")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
MAX_DEPTH = 256  # levels of nested schemas (a deeper one would exhaust Python's stack here, or the compiler's)
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
               type(None): "null"}


def normalize(schema: Any, param: str) -> Any:
    """A copy of ``schema`` that the grammar enforces as written (the module's rules), or a `RequestError`."""
    return _Normalizer(schema, param).walk(schema, "#")


def embed(schema: Any, name: str) -> tuple[dict, dict]:
    """(a reference to ``schema``, {``name``: ``schema``}) for a schema placed in another's ``$defs`` under
    ``name``: its local ``$ref`` s ("#", "#/...") are rewritten to point inside ``#/$defs/name``. ``name`` holds no
    "/" or "~"."""
    at = f"#/$defs/{name}"

    def rewrite(node):
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                out["$ref"] = at + ref[1:]
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    return {"$ref": at}, {name: rewrite(schema)}


class _Normalizer:
    def __init__(self, root: Any, param: str):
        self.root, self.param = root, param

    def refuse(self, where: str, what: str) -> RequestError:
        return RequestError(f"{self.param}: {what} (at {where}) is not supported by structured output", self.param)

    def walk(self, schema: Any, where: str, depth: int = 0) -> Any:
        if not isinstance(schema, dict):
            return schema
        if depth > MAX_DEPTH:
            raise RequestError(f"{self.param}: the JSON schema nests deeper than {MAX_DEPTH} levels (at "
                               f"{where[:80]}...)", self.param)
        self.check(schema, where)
        out = {}
        for key, value in _tuple_items(schema).items():
            if key in _MAPS and isinstance(value, dict):
                value = {name: self.walk(s, f"{where}/{key}/{name}", depth + 1) for name, s in value.items()}
            elif key in _ONE:
                value = self.walk(value, f"{where}/{key}", depth + 1)
            elif key in _LISTS and isinstance(value, list):
                value = [self.walk(s, f"{where}/{key}/{i}", depth + 1) for i, s in enumerate(value)]
            out[key] = value
        return self.add_required(self.typed_values(out, where), where)

    def typed_values(self, s: dict, where: str) -> dict:
        """``enum`` / ``const`` beside ``type``: the listed values of other types dropped (an instance must satisfy
        both, and the grammar would write them), or a `RequestError` if none is left."""
        types = _types({"type": s["type"]}) if "type" in s else None
        if types is None:
            return s
        fits = [v for v in _values(s) or () if _has_type(v, types)]
        if "const" in s and not fits:
            raise RequestError(f"{self.param}: the 'const' (at {where}) is not of the schema's 'type': no output can "
                               "match", self.param)
        if isinstance(s.get("enum"), list) and len(fits) < len(s["enum"]):
            if not fits:
                raise RequestError(f"{self.param}: no value of the 'enum' (at {where}) is of the schema's 'type': no "
                                   "output can match", self.param)
            return {**s, "enum": fits}
        return s

    def check(self, s: dict, where: str) -> None:
        for key in UNSUPPORTED:
            if key in s:
                raise self.refuse(where, f"the JSON schema keyword {key!r}")
        if s.get("uniqueItems") is True:
            raise self.refuse(where, "the JSON schema keyword 'uniqueItems'")
        if "multipleOf" in s and not (s.get("type") == "integer" and _is_int(s["multipleOf"])):
            raise self.refuse(where, "'multipleOf' other than a whole number on an integer")
        if "pattern" in s and ("minLength" in s or "maxLength" in s):
            raise self.refuse(where, "'minLength' / 'maxLength' beside 'pattern' (put the length into the pattern)")
        for comb in COMBINATORS:
            if comb not in s:
                continue
            others = [k for k in s if k not in ANNOTATIONS and k not in COMBINATORS]
            if others or sum(c in s for c in COMBINATORS) > 1:
                raise self.refuse(where, f"{comb!r} beside {', '.join(repr(k) for k in others or COMBINATORS)} "
                                         "(move them into each alternative)")
        if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
            raise self.refuse(where, "'allOf' of more than one schema (merge them into one)")
        if isinstance(s.get("oneOf"), list):
            self.check_one_of(s["oneOf"], where)
        need = len([k for k in s.get("required", ()) if k in s.get("properties", {})])
        # (the grammar is compiled strict: without additionalProperties an object has only its properties; past
        # them, one more key cannot collide with another)
        open_keys = "patternProperties" in s or s.get("additionalProperties", False) is not False
        if open_keys and _is_int(s.get("minProperties")) and s["minProperties"] > need + 1:
            raise self.refuse(where, "'minProperties' where keys come from 'patternProperties' or "
                                     "'additionalProperties' (a key could repeat)")

    def check_one_of(self, alternatives: list, where: str) -> None:
        resolved = [self.resolve(a) for a in alternatives]
        for i in range(len(resolved)):
            for j in range(i + 1, len(resolved)):
                a, b = resolved[i], resolved[j]
                if a is None or b is None:  # (a reference the compiler will report)
                    continue
                if not _disjoint(a, b, self.resolve):
                    raise RequestError(
                        f"{self.param}: 'oneOf' (at {where}) is enforced as 'anyOf', and its alternatives {i} and {j} "
                        "may both match: use 'anyOf', or make them exclusive (different types, or a required "
                        "property with different 'const' values)", self.param)

    def resolve(self, s: Any, depth: int = 0) -> Any:
        """``s`` with a local ``$ref`` followed (None where it does not resolve)."""
        ref = s.get("$ref") if isinstance(s, dict) else None
        if ref is None:
            return s
        if depth > 32 or not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = self.root
        for part in (p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/")[1:]):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return self.resolve(node, depth + 1)

    def add_required(self, s: dict, where: str) -> dict:
        props = s.get("properties", {})
        required = s.get("required")
        if not isinstance(required, list) or not isinstance(props, dict):
            return s
        missing = [k for k in required if isinstance(k, str) and k not in props]
        if not missing:
            return s
        extra = s.get("additionalProperties", True)
        if extra is False or "patternProperties" in s:
            why = "'additionalProperties' is false" if extra is False else "'patternProperties' may govern it"
            raise RequestError(f"{self.param}: the required property {missing[0]!r} (at {where}) is not in "
                               f"'properties' and {why}: list it in 'properties'", self.param)
        value = {} if extra is True else extra
        return {**s, "properties": {**props, **{k: value for k in missing}}}


def _tuple_items(s: dict) -> dict:
    """An array's ``items`` given as a list (draft 4-7) in the 2020-12 form the grammar reads: ``prefixItems``, then
    ``additionalItems`` as ``items``."""
    if not isinstance(s.get("items"), list):
        return s
    out = {k: v for k, v in s.items() if k not in ("items", "additionalItems")}
    out["prefixItems"] = s["items"]
    if "additionalItems" in s:
        out["items"] = s["additionalItems"]
    return out


def _has_type(value, types: set) -> bool:
    t = _JSON_TYPES.get(type(value))
    return t in types or (t == "integer" and "number" in types) or (t == "number" and "integer" in types
                                                                      and float(value).is_integer())


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) or isinstance(x, float) and x.is_integer()


def _forbids(s: dict, key: str) -> bool:
    """Whether an instance of ``s`` cannot hold ``key`` (as a validator reads it: other keys are allowed unless
    ``additionalProperties`` is false)."""
    return ("patternProperties" not in s and s.get("additionalProperties", True) is False
            and key not in s.get("properties", {}))


def _types(s: Any) -> Optional[set]:
    """The JSON types a schema's instances can have (None: any, or not known here)."""
    if not isinstance(s, dict):
        return None
    if "const" in s:
        return {_JSON_TYPES.get(type(s["const"]), "?")}
    if isinstance(s.get("enum"), list):
        return {_JSON_TYPES.get(type(v), "?") for v in s["enum"]}
    t = s.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    return None


def _values(s: Any) -> Optional[list]:
    """The values a schema allows, where it lists them (const / enum); else None."""
    if isinstance(s, dict):
        if "const" in s:
            return [s["const"]]
        if isinstance(s.get("enum"), list):
            return s["enum"]
    return None


def _disjoint(a: Any, b: Any, resolve) -> bool:
    """Whether no instance can match both schemas, as far as these simple tests tell."""
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None:
        widen = {"integer": {"integer", "number"}, "number": {"integer", "number"}}
        if not any(widen.get(x, {x}) & tb for x in ta):
            return True
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    pa, pb = a.get("properties", {}), b.get("properties", {})
    if not (isinstance(pa, dict) and isinstance(pb, dict)):
        return False
    for key in set(a.get("required", ())) & set(b.get("required", ())):
        va, vb = _values(resolve(pa.get(key))), _values(resolve(pb.get(key)))
        if va is not None and vb is not None and not any(x == y and type(x) is type(y) for x in va for y in vb):
            return True
    for s, other in ((a, b), (b, a)):  # one requires a key the other forbids
        if any(isinstance(k, str) and _forbids(other, k) for k in s.get("required", ())):
            return True
    return False
