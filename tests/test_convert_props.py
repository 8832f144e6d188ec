"""Property tests of zarrckpt.convert: random nested state dicts (None, bools, ints up to the
spec's 1000 digits, floats with nan/inf/-0.0, Unicode strings, bytes, lists, tuples, int
keys, nested and empty containers, 0-d and empty tensors of every dtype zarrckpt stores)
come back equal from every converter direction; tensors bit for bit. Where the target
cannot hold a value (safetensors: tensors only), the documented behaviour is checked: the
leaf is skipped and listed in the report, or the conversion is refused with a clear error.
zarrckpt -> DCP writes the items dcp.save writes, so DCP's own loaders (dcp_to_torch_save,
dcp.load into the state dict) read every generated state. Then the real optimizer states
of AdamW, SGD with momentum and Adafactor, with their None hyperparameters, through
torch.save and DCP, both ways."""

from __future__ import annotations

import math
import os
import struct
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, reject, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

import zarrckpt
from zarrckpt.tools import convert
from zarrckpt.format import dtypes
from zarrckpt.errors import UnsupportedValueError
from zarrckpt.interop.safetensors_io import FROM_ZARR
from zarrckpt.format.tree import escape, flatten, key_of

safetensors_torch = pytest.importorskip("safetensors.torch")

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

# ------------------------------------------------------------------ strategies


@st.composite
def tensors(draw, names=dtypes.ZARR_NAMES):
    """A tensor of any stored dtype and any bits (NaN payloads included), 0-d and empty too."""
    row = dtypes.by_zarr(draw(st.sampled_from(names)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = math.prod(shape)
    if row.zarr == "bool":
        data = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_)
    else:
        raw = draw(st.binary(min_size=n * row.numpy.itemsize, max_size=n * row.numpy.itemsize))
        data = np.frombuffer(raw, np.uint8).copy().view(row.numpy)
    return dtypes.from_numpy(data.reshape(shape), row)


# the largest integers torch.load(weights_only=True) reads (255 bytes); zarrckpt's own limit,
# 1000 digits, is larger: see test_integers_torch_cannot_read
BIG_INTS = st.sampled_from([2**63, -(2**63) - 1, 2**64, 2**2039 - 1, -(2**2039)])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), BIG_INTS,
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, math.inf, -math.inf]),
    st.text(max_size=6), st.binary(min_size=1, max_size=12),  # b'': test_empty_bytes
)
KEYS = st.one_of(st.text(max_size=6), st.sampled_from(["", ".", "..", "__x", "zarr.json", "a/b", "%", "é"]),
                 st.integers(0, 12))


def _distinct_segments(d: dict) -> bool:
    """No two keys of one dict share a stored name (an int and its decimal string)."""
    return len({escape(k) for k in d}) == len(d)


def _dicts(values):
    return st.dictionaries(KEYS, values, max_size=4).filter(_distinct_segments)


def values(leaves=None):
    leaves = leaves if leaves is not None else st.one_of(SCALARS, tensors())
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple), _dicts(inner)), max_leaves=10)


STATES = _dicts(values())

# ------------------------------------------------------------------ equality


def _float_same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return struct.pack("<d", a) == struct.pack("<d", b)  # -0.0 is not 0.0


def assert_equal(got, want, where="<root>", ordered=True) -> None:
    """Equal in type and value: tensors bit for bit (dtype and shape too), NaN == NaN,
    -0.0 != 0.0; dict keys in the same order when ``ordered``."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), (where, type(got))
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
        return
    if isinstance(want, dict):  # dict subclasses (a module's OrderedDict) come back as dicts
        assert type(got) is dict, (where, type(got))
        assert (list(got) if ordered else sorted(map(repr, got))) == (
            list(want) if ordered else sorted(map(repr, want))), where
        for k in want:
            assert_equal(got[k], want[k], f"{where}/{k!r}", ordered)
        return
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_equal(a, b, f"{where}/{i}", ordered)
    elif isinstance(want, float):
        assert _float_same(got, want), (where, got, want)
    else:
        assert got == want, (where, got, want)


def dcp_form(state: dict):
    """What DCP's own loader gives back for ``state``: DCP's own flattening
    (``flatten_state_dict``: dict keys become strings; a tuple, and a list holding neither
    a tensor nor a dict nor such a list, is one value; an empty dict outside such a value
    leaves nothing) undone by its own ``unflatten_state_dict``. None when DCP refuses the
    state (two leaves flatten to one name, ``"a.b"``)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict

    try:
        flat, mapping = flatten_state_dict(state)
    except ValueError as e:
        if "duplicated flatten key" in str(e):
            return None
        raise
    return unflatten_state_dict(flat, mapping)


def _dcp_items(path: str) -> dict[str, str]:
    """The items of a DCP checkpoint: {name: kind of storage metadata}."""
    from zarrckpt.interop.dcp import read_metadata

    return {k: type(v).__name__ for k, v in read_metadata(path).state_dict_metadata.items()}


def _blank(obj):
    """A state dict of ``obj``'s structure for DCP's in-place load: tensors zeroed, other
    leaves a marker (so that a value DCP does not load shows)."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _blank(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_blank(v) for v in obj)
    return "<not loaded>"


def _dcp_load_into(state: dict, path: str) -> dict | type:
    """DCP's own in-place ``dcp.load`` into a state dict shaped like ``state``, or the class
    of the error DCP raises (it sorts the top-level keys, so int and str keys together are
    a TypeError; some key paths fail its planner)."""
    import torch.distributed.checkpoint as dcp

    target = _blank(state)
    try:
        dcp.load(target, checkpoint_id=path, no_dist=True)
    except (TypeError, CheckpointException) as e:
        return type(e)
    return target


def _fresh(tmp_path, name: str) -> str:
    """A new path per example (hypothesis reuses the function-scoped tmp_path)."""
    _fresh.n = getattr(_fresh, "n", 0) + 1
    stem, dot, suffix = name.partition(".")
    return str(tmp_path / f"{stem}{_fresh.n}{dot}{suffix}")


def _dcp_save(state, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(state, checkpoint_id=path, no_dist=True)
    except (ValueError, CheckpointException) as e:  # DCP's own refusal: two leaves flatten to
        if "duplicated flatten key" in str(e):      # one name ("a.b"); raised as it is, or
            reject()                                # wrapped by DCP's planning step
        raise


def _dcp_load(path: str):
    """What DCP's own loader gives back."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path + ".pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


# ------------------------------------------------------------------ torch.save


@SETTINGS
@given(state=STATES)
def test_torch_save_both_ways(tmp_path, state):
    src, ck, back = _fresh(tmp_path, "in.pt"), _fresh(tmp_path, "ck"), _fresh(tmp_path, "out.pt")
    torch.save(state, src)
    r = convert.from_torch_save(src, ck)
    assert not r.skipped
    assert_equal(zarrckpt.load_state_dict(ck), state)
    convert.to_torch_save(ck, back)
    assert_equal(torch.load(back, weights_only=True), state)


@SETTINGS
@given(state=STATES)
def test_save_then_to_torch_save(tmp_path, state):
    """zarrckpt.save itself, then zarrckpt -> torch.save."""
    ck, out = _fresh(tmp_path, "ck"), _fresh(tmp_path, "out.pt")
    zarrckpt.save(state, ck)
    assert_equal(zarrckpt.load_state_dict(ck), state)
    convert.to_torch_save(ck, out)
    assert_equal(torch.load(out, weights_only=True), state)


def _containers(state: dict) -> list:
    return [k for k, v in state.items() if isinstance(v, (dict, list, tuple)) and v]


@SETTINGS
@given(state=STATES, data=st.data())
def test_key_selection_keeps_the_subtree(tmp_path, state, data):
    """``keys={"<k>/": ""}`` makes a subtree the root: indexes stay ints, lists stay lists,
    through torch.save -> zarrckpt and zarrckpt -> torch.save alike."""
    assume(_containers(state))
    k = data.draw(st.sampled_from(_containers(state)))
    sub = state[k]
    want = dict(enumerate(sub)) if isinstance(sub, (list, tuple)) else sub
    prefix = key_of((k,)) + "/"
    src, ck, sel, out = (_fresh(tmp_path, n) for n in ("in.pt", "ck", "sel", "out.pt"))
    torch.save(state, src)
    convert.from_torch_save(src, sel, keys={prefix: ""})
    assert_equal(zarrckpt.load_state_dict(sel), want)
    convert.from_torch_save(src, ck, keys=[prefix])  # a prefix selects, names unchanged
    assert_equal(zarrckpt.load_state_dict(ck), {k: sub})
    convert.to_torch_save(ck, out, keys={prefix: "moved/"})  # "moved" holds what k held
    assert_equal(torch.load(out, weights_only=True), {"moved": sub})


@pytest.mark.parametrize("to", [convert.to_torch_save, convert.to_dcp])
def test_integers_torch_cannot_read(tmp_path, to):
    """An integer zarrckpt holds (up to 1000 digits) but torch.load(weights_only=True) does
    not (over 255 bytes): refused by name, or skipped and listed with strict=False; never
    written into a file that cannot be read back."""
    huge = 10**999 - 1
    zarrckpt.save({"w": torch.ones(2), "n": {"big": huge, "ok": 2**2039 - 1}}, tmp_path / "ck")
    assert zarrckpt.load_state_dict(tmp_path / "ck")["n"]["big"] == huge
    out = tmp_path / ("out.pt" if to is convert.to_torch_save else "dcp")
    with pytest.raises(UnsupportedValueError, match="'n'.*more than 255 bytes.*weights_only"):
        to(tmp_path / "ck", out)
    assert not os.path.exists(out)
    r = to(tmp_path / "ck", out, strict=False)
    assert [k for k, _ in r.skipped] == ["n"]
    got = torch.load(out, weights_only=True) if to is convert.to_torch_save else _dcp_load(str(out))
    assert_equal(got, {"w": torch.ones(2)})


@pytest.mark.parametrize("to", [convert.to_torch_save, convert.to_dcp])
def test_empty_bytes(tmp_path, to):
    """torch pickles b'' as a call of bytes(), which torch.load(weights_only=True) refuses:
    zarrckpt keeps b'', the torch converters refuse it by name or skip it (strict=False)."""
    zarrckpt.save({"w": torch.ones(2), "blob": b"", "rng": b"\x01"}, tmp_path / "ck")
    assert zarrckpt.load_state_dict(tmp_path / "ck")["blob"] == b""
    out = tmp_path / ("out.pt" if to is convert.to_torch_save else "dcp")
    with pytest.raises(UnsupportedValueError, match="'blob'.*empty bytes"):
        to(tmp_path / "ck", out)
    r = to(tmp_path / "ck", out, strict=False)
    assert [k for k, _ in r.skipped] == ["blob"]
    got = torch.load(out, weights_only=True) if to is convert.to_torch_save else _dcp_load(str(out))
    assert_equal(got, {"w": torch.ones(2), "rng": b"\x01"}, ordered=False)
    torch.save({"blob": b""}, tmp_path / "in.pt")
    with pytest.raises(UnsupportedValueError, match="weights_only=True"):  # torch's own refusal, named
        convert.from_torch_save(tmp_path / "in.pt", tmp_path / "ck2")


def test_torch_save_of_an_integer_torch_cannot_read(tmp_path):
    torch.save({"big": 2**2039}, tmp_path / "in.pt")  # torch writes it, and refuses to read it
    with pytest.raises(UnsupportedValueError, match="weights_only=True"):
        convert.from_torch_save(tmp_path / "in.pt", tmp_path / "ck")
    assert not os.path.exists(tmp_path / "ck")


# ------------------------------------------------------------------ DCP


@SETTINGS
@given(state=STATES)
def test_from_dcp_matches_dcp_itself(tmp_path, state):
    """DCP -> zarrckpt gives what DCP's own loader gives (DCP turns dict keys into strings
    and drops empty dicts: that is DCP's, not the converter's)."""
    src, ck = _fresh(tmp_path, "dcp"), _fresh(tmp_path, "ck")
    _dcp_save(state, src)
    try:
        want = _dcp_load(src)
    except CheckpointException:  # DCP's own loader fails on some of its own key paths
        reject()                 # ('..', '' and '.' keys together): no oracle then
    r = convert.from_dcp(src, ck)
    assert not r.skipped
    assert_equal(zarrckpt.load_state_dict(ck), want, ordered=False)


@SETTINGS
@given(state=STATES)
def test_to_dcp_and_back(tmp_path, state):
    """zarrckpt -> DCP writes what ``dcp.save`` writes: DCP's own loaders
    (``dcp_to_torch_save``, and ``dcp.load`` into a state dict of the same shape) read
    every converted checkpoint as they read dcp.save's own checkpoint of the state, and
    give back what DCP's flattening keeps; ``from_dcp`` reads it back the same."""
    ck, out, back, ref = (_fresh(tmp_path, n) for n in ("ck", "dcp", "back", "ref"))
    zarrckpt.save(state, ck)
    want = dcp_form(state)
    if want is None:  # DCP itself refuses it: two leaves with one DCP name
        with pytest.raises(UnsupportedValueError, match="have the DCP name"):
            convert.to_dcp(ck, out)
        assert not os.path.exists(out)
        return
    convert.to_dcp(ck, out)
    _dcp_save(state, ref)
    assert _dcp_items(out) == _dcp_items(ref)  # the items dcp.save makes, tensor or bytes alike
    try:
        theirs = _dcp_load(ref)
    except CheckpointException:  # DCP's own loader fails on its own checkpoint of some key
        with pytest.raises(CheckpointException):  # paths ('..', '' and '.' keys together):
            _dcp_load(out)                        # on ours alike
        return
    assert_equal(theirs, want, ordered=False)
    assert_equal(_dcp_load(out), want, ordered=False)
    assert_equal(_dcp_load_into(state, out), _dcp_load_into(state, ref), ordered=False)
    convert.from_dcp(out, back)
    assert_equal(zarrckpt.load_state_dict(back), want, ordered=False)


# ------------------------------------------------------------------ safetensors

ST_NAMES = tuple(n for n in dtypes.ZARR_NAMES if n in FROM_ZARR)
FLAT = st.dictionaries(st.text(min_size=1, max_size=8), tensors(ST_NAMES), max_size=5)


@SETTINGS
@given(flat=FLAT)
def test_safetensors_both_ways(tmp_path, flat):
    src, ck, out = _fresh(tmp_path, "in.safetensors"), _fresh(tmp_path, "ck"), _fresh(tmp_path, "o.safetensors")
    safetensors_torch.save_file(flat, src)
    convert.from_safetensors(src, ck)
    assert_equal(zarrckpt.load_state_dict(ck), flat, ordered=False)
    convert.to_safetensors(ck, out)
    assert_equal(safetensors_torch.load_file(out), flat, ordered=False)


def _under(key: str, skipped: set[str]) -> bool:
    return any(key == s or key.startswith(s + "/") for s in skipped)


@SETTINGS
@given(state=STATES)
def test_to_safetensors_skips_what_it_cannot_hold(tmp_path, state):
    """safetensors holds tensors only: every other leaf (and a tensor of a dtype without a
    safetensors form, strict=False) is skipped and listed in the report; strict=True
    refuses such a tensor."""
    ck, out = _fresh(tmp_path, "ck"), _fresh(tmp_path, "o.safetensors")
    zarrckpt.save(state, ck)
    leaves = list(flatten(state, lambda x: isinstance(x, torch.Tensor)))
    names = [".".join(map(str, p)) for p, v in leaves if isinstance(v, torch.Tensor)]
    assume(len(set(names)) == len(names))  # else: refused, tested in test_convert.py
    no_form = [p for p, v in leaves if isinstance(v, torch.Tensor) and str(v.dtype)[6:] not in FROM_ZARR]
    if no_form:
        with pytest.raises(UnsupportedValueError, match="has no safetensors dtype"):
            convert.to_safetensors(ck, out)
        assert not os.path.exists(out)
    r = convert.to_safetensors(ck, out, strict=False)
    skipped = {k for k, _ in r.skipped}
    got = safetensors_torch.load_file(out)
    want = {".".join(map(str, p)): v for p, v in leaves if isinstance(v, torch.Tensor) and p not in no_form}
    assert_equal(got, want, ordered=False)
    for p, v in leaves:  # nothing vanishes silently
        if not (isinstance(v, torch.Tensor) and p not in no_form):
            assert _under(key_of(p), skipped), (p, r.skipped)


# ------------------------------------------------------------------ real optimizer states


def _trained(opt_cls, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = opt_cls(model.parameters(), **kw)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}


OPTIMIZERS = [(torch.optim.AdamW, {}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})]
if hasattr(torch.optim, "Adafactor"):
    OPTIMIZERS.append((torch.optim.Adafactor, {}))


@pytest.fixture(params=OPTIMIZERS, ids=lambda p: p[0].__name__)
def trained(request):
    cls, kw = request.param
    state = _trained(cls, **kw)
    groups = state["optim"]["param_groups"]
    assert any(v is None for g in groups for v in g.values())  # foreach / fused / ... None
    return state


def test_optimizer_state_through_torch_save(tmp_path, trained):
    torch.save(trained, tmp_path / "in.pt")
    convert.from_torch_save(tmp_path / "in.pt", tmp_path / "ck")
    got = zarrckpt.load_state_dict(tmp_path / "ck")
    assert_equal(got, trained)
    convert.to_torch_save(tmp_path / "ck", tmp_path / "out.pt")
    assert_equal(torch.load(tmp_path / "out.pt", weights_only=True), trained)
    convert.from_torch_save(tmp_path / "in.pt", tmp_path / "opt", keys={"optim/": ""})
    assert_equal(zarrckpt.load_state_dict(tmp_path / "opt"), trained["optim"])
    zarrckpt.save(trained, tmp_path / "saved")  # the library's own save, None values included
    assert_equal(zarrckpt.load_state_dict(tmp_path / "saved"), trained)


def test_optimizer_state_through_dcp(tmp_path, trained):
    import torch.distributed.checkpoint as dcp

    dcp.save(trained, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    convert.from_dcp(tmp_path / "dcp", tmp_path / "ck")
    want = _dcp_load(str(tmp_path / "dcp"))  # DCP's own reading: its keys are strings
    assert_equal(zarrckpt.load_state_dict(tmp_path / "ck"), want, ordered=False)
    assert [v for g in want["optim"]["param_groups"] for v in g.values() if v is None]
    zarrckpt.save(trained, tmp_path / "saved")
    convert.to_dcp(tmp_path / "saved", tmp_path / "dcp2")
    assert _dcp_items(str(tmp_path / "dcp2")) == _dcp_items(str(tmp_path / "dcp"))  # as dcp.save's
    want = dcp_form(trained)  # the whole state: param_groups with betas tuples, None values
    if "betas" in trained["optim"]["param_groups"][0]:
        assert type(want["optim"]["param_groups"][0]["betas"]) is tuple
    assert [v for g in want["optim"]["param_groups"] for v in g.values() if v is None]
    assert_equal(_dcp_load(str(tmp_path / "dcp2")), want, ordered=False)  # dcp_to_torch_save
    got = _dcp_load_into(trained, str(tmp_path / "dcp2"))  # DCP's in-place dcp.load
    assert_equal(got, _dcp_load_into(trained, str(tmp_path / "dcp")), ordered=False)  # as from dcp.save's
    assert_equal(got["model"], trained["model"])
    assert_equal(got["optim"]["param_groups"], trained["optim"]["param_groups"])
    convert.from_dcp(tmp_path / "dcp2", tmp_path / "back")
    assert_equal(zarrckpt.load_state_dict(tmp_path / "back"), want, ordered=False)
