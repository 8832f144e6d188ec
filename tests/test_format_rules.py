"""The on-storage naming and classification rules that zarrckpt.format.documents owns (issue
15 item 2): chunk keys (spec §5.1), step directories of a run (§7.7), the names of a save's
leftovers (§7.5) and the lenient root classification used by claims, listings and
retention (§7.1). Property tests check each parser against its builder."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zarrckpt.format import documents as fmt

SAVE_IDS = st.text("0123456789abcdef", min_size=16, max_size=64)
NAMES = st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1,
                max_size=40)


@given(st.lists(st.integers(0, 10**6), max_size=6))
def test_chunk_key_is_zarr_default_encoding_with_slashes(index):
    key = fmt.chunk_key(index)
    parts = key.split("/")
    assert parts[0] == "c" and [int(p) for p in parts[1:]] == index


def test_chunk_key_of_a_0d_array_is_c():
    assert fmt.chunk_key(()) == "c"


@given(st.integers(0, 10**12))
def test_step_names_round_trip_and_sort_by_step_up_to_8_digits(step):
    name = fmt.step_name(step)
    assert fmt.parse_step_name(name) == step
    if step < 10**8:
        assert len(name) == len("step_") + 8


@pytest.mark.parametrize("name, step", [("step_1", 1), ("step_0000000000042", 42), ("step_00000000", 0)])
def test_any_number_of_digits_is_a_step(name, step):
    assert fmt.parse_step_name(name) == step


@pytest.mark.parametrize("name", ["step_", "step_1a", "step_-1", "Step_1", ".step_1.zarrckpt-" + "ab" * 8,
                                  "step_1/", " step_1", "step_１"])
def test_other_names_are_not_steps(name):
    assert fmt.parse_step_name(name) is None


@pytest.mark.parametrize("step", [-1, True, 1.0, "1"])
def test_step_name_refuses_what_is_not_a_step(step):
    with pytest.raises(ValueError):
        fmt.step_name(step)


@given(NAMES, SAVE_IDS)
def test_leftover_names_round_trip(name, save_id):
    assert fmt.parse_leftover_name(fmt.lock_name(name, save_id)) == ("lock", name, save_id)
    assert fmt.parse_leftover_name(fmt.staging_name(name, save_id)) == ("directory", name, save_id)
    assert fmt.parse_leftover_name(fmt.staging_name(name, save_id) + "-old") == ("directory", name, save_id)


@pytest.mark.parametrize("entry", ["ckpt", ".ckpt", ".ckpt.zarrckpt-short", ".ckpt.zarrckpt-" + "AB" * 8,
                                   "step_00000001", ".ckpt.zarrckpt-" + "ab" * 8 + ".lock.x"])
def test_other_entries_are_not_leftovers(entry):
    assert fmt.parse_leftover_name(entry) is None


def _root(**attrs) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {"zarrckpt": attrs}}).encode()


@pytest.mark.parametrize("data, state", [
    (None, "absent"),
    (_root(format="zarrckpt", state="committed", save_id="ab" * 8), "committed"),
    (_root(format="zarrckpt", state="pending", save_id="ab" * 8), "pending"),
    (_root(format="zarrckpt", state="weird"), "pending"),  # not committed: never used as one
    (_root(format="other", state="committed"), "foreign"),
    (b'{"zarr_format": 3, "node_type": "group", "attributes": {}}', "foreign"),
    (b"not json", "foreign"),
    (b"[1, 2]", "foreign"),
    (b"\xff\xfe", "foreign"),
    (b"[" * 100000, "foreign"),
])
def test_root_state(data, state):
    got, attrs = fmt.root_state(data)
    assert got == state
    assert (attrs.get("format") == "zarrckpt") == (state in ("committed", "pending"))


def test_root_attributes_reads_pending_and_damaged_roots_leniently():
    assert fmt.root_attributes(_root(format="zarrckpt", state="pending"))["state"] == "pending"
    assert fmt.root_attributes(_root(format="something else")) == {"format": "something else"}
    assert fmt.root_attributes(b"{") is None and fmt.root_attributes(None) is None


@given(st.text(max_size=80))
def test_is_save_id(text):
    assert fmt.is_save_id(text) == (16 <= len(text) <= 64 and all(c in "0123456789abcdef" for c in text))


TRAINER_PATTERNS = [r"step-(\d+)", r"step_(\d+)", r"checkpoint-(\d+)", r"epoch=.*-step=", r"step=(\d+)"]


@given(st.sampled_from(["step-15", "step_00000015", "checkpoint-500", "epoch=3-step=1200", "step=7", "ckpt"]),
       SAVE_IDS)
def test_no_leftover_name_matches_a_trainers_checkpoint_pattern(name, save_id):
    """Issue 17 item 4 (spec §7.5): torchtitan purges by ``step-(\\d+)``, Hugging Face by
    ``checkpoint-(\\d+)``, Lightning by ``epoch=..-step=..``; a save in flight must not look
    like a checkpoint to them, whatever the name it saves to."""
    import re

    for entry in (fmt.staging_name(name, save_id), fmt.staging_name(name, save_id) + "-old",
                  fmt.lock_name(name, save_id)):
        assert not any(re.search(p, entry) for p in TRAINER_PATTERNS), entry
        assert len(entry.encode()) <= 255


def test_long_names_are_hashed_and_still_matched():
    name = "x" * 150
    entry = fmt.staging_name(name, "ab" * 15)
    assert len(entry) < 255 and "x" not in entry
    kind, got, sid = fmt.parse_leftover_name(entry)
    assert kind == "directory" and got == fmt.leftover_name(name) and sid == "ab" * 15
    assert fmt.lock_name(got, sid) == fmt.lock_name(name, sid)  # the stand-in names the same lock


def test_leftovers_of_zarrckpt_0_1_are_still_recognized():
    sid = "ab" * 15
    assert fmt.parse_leftover_name(f".step-15.zarrckpt-{sid}") == ("directory", "step-15", sid)
    assert fmt.parse_leftover_name(f".step-15.zarrckpt-{sid}.lock") == ("lock", "step-15", sid)
