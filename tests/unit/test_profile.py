"""Tests for perseus_api.profile: the shipped profiles, both CSV forms, and bad input."""

from __future__ import annotations

import csv
import pickle
from pathlib import Path

import numpy as np
import pytest

from perseus_api.errors import ApiError, ProfileError
from perseus_api.profile import (
    Measurements,
    Profile,
    load_profile,
    parse_profile,
)

WHOLE_BACKWARD = ("forward", "backward")
"""The instructions of the shipped profiles and of most test profiles (backward not split)."""

PROFILES_DIR = Path(__file__).resolve().parents[2] / "operator" / "perseus_planner" / "profiles"

A100_FREQUENCIES_MHZ = list(range(1410, 854, -15))
A40_FREQUENCIES_MHZ = list(range(1740, 854, -15))

REAL_PROFILES = {
    "bloom+a100_sxm_bf16.csv": A100_FREQUENCIES_MHZ,
    "bloom+a40_bf16.csv": A40_FREQUENCIES_MHZ,
    "gpt3-175b+a100_sxm_bf16.csv": A100_FREQUENCIES_MHZ,
    "gpt3-175b+a40_bf16.csv": A40_FREQUENCIES_MHZ,
}

HEADER = "stage,instruction,frequency,time,energy"


def _valid_lines() -> list[str]:
    """A minimal valid simple-form profile: 2 stages, both instructions, 2 clocks each.

    Index ``i`` of the returned list is file line ``i + 1``.
    """
    lines = [HEADER]
    for stage in range(2):
        for frequency_mhz in (1410, 1200):
            lines.append(f"{stage},forward,{frequency_mhz},0.{stage + 1}0,{stage + 10}.5")
            lines.append(f"{stage},backward,{frequency_mhz},0.{stage + 3}0,{stage + 20}.5")
    return lines


def _write(tmp_path: Path, lines: list[str], name: str = "profile.csv") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _expect_error(path: Path, line: int | None, *phrases: str) -> ProfileError:
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    error = info.value
    message = str(error)
    assert str(path) in message
    assert error.source == str(path)
    assert error.row == line
    if line is None:
        assert "line " not in message.removeprefix(str(path))
    else:
        assert f"line {line}:" in message
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in {message!r}"
    return error


def _with_line(lines: list[str], line: int, text: str) -> list[str]:
    changed = list(lines)
    changed[line - 1] = text
    return changed


# --------------------------------------------------------------------------- shipped profiles


@pytest.mark.parametrize("name", sorted(REAL_PROFILES))
def test_real_profiles_load(name: str) -> None:
    path = PROFILES_DIR / name
    profile = load_profile(path)
    expected_frequencies_mhz = REAL_PROFILES[name]

    assert profile.source == str(path)
    assert profile.num_stages == 8
    assert set(profile.measurements) == {(s, i) for s in range(8) for i in WHOLE_BACKWARD}
    assert profile.frequencies_mhz.tolist() == expected_frequencies_mhz
    assert profile.frequencies_mhz.dtype == np.int64
    assert profile.max_frequency_mhz == expected_frequencies_mhz[0]

    # Compare every (stage, instruction) against an independent reading of the file, which
    # checks both the parsed values and that rows stay in file order.
    with path.open(newline="") as handle:
        records = list(csv.DictReader(handle))
    for stage in range(8):
        for instruction in WHOLE_BACKWARD:
            mine = [
                r for r in records if (int(r["stage"]), r["instruction"]) == (stage, instruction)
            ]
            measured = profile.get(stage, instruction)
            assert len(measured) == len(expected_frequencies_mhz)
            assert measured.frequencies_mhz.dtype == np.int64
            assert measured.times_s.dtype == np.float64
            assert measured.energies_j.dtype == np.float64
            assert measured.frequencies_mhz.tolist() == [int(r["frequency"]) for r in mine]
            assert measured.times_s.tolist() == [float(r["time"]) for r in mine]
            assert measured.energies_j.tolist() == [float(r["energy"]) for r in mine]


def test_real_profile_known_value() -> None:
    profile = load_profile(PROFILES_DIR / "gpt3-175b+a100_sxm_bf16.csv")
    forward = profile.get(0, "forward")
    assert forward.frequencies_mhz[0] == 1410
    assert forward.times_s[0] == 0.05016166687011708
    assert forward.energies_j[0] == 23.80547200000007
    # Second forward row of stage 0 in the file.
    assert forward.frequencies_mhz[1] == 1395
    assert forward.times_s[1] == 0.0501853656768798
    assert forward.energies_j[1] == 23.81079199999944
    assert profile.get(0, "backward").times_s[0] == 0.092953779220581


# --------------------------------------------------------------------------- simple form


def test_simple_form_keeps_file_order_and_accepts_variants(tmp_path: Path) -> None:
    # Columns shuffled, an extra column, mixed-case names, float-written clocks, a trailing
    # blank line, and clocks deliberately out of order.
    lines = [
        "Energy,Time,Instruction,Note,Frequency,Stage",
        "5.0,0.5,Forward,x,1000,0",
        "7.0,0.3,FORWARD,y,1200.0,0",
        "6.0,0.4,forward,z,1100,0",
        "9.0,0.9,backward,,1100,0",
        "8.0,1.0,backward,,1000,0",
        "",
    ]
    profile = load_profile(_write(tmp_path, lines))
    assert profile.num_stages == 1
    forward = profile.get(0, "forward")
    assert forward.frequencies_mhz.tolist() == [1000, 1200, 1100]
    assert forward.times_s.tolist() == [0.5, 0.3, 0.4]
    assert forward.energies_j.tolist() == [5.0, 7.0, 6.0]
    backward = profile.get(0, "BACKWARD")
    assert backward.frequencies_mhz.tolist() == [1100, 1000]
    assert backward.times_s.tolist() == [0.9, 1.0]
    assert profile.frequencies_mhz.tolist() == [1200, 1100, 1000]
    assert profile.max_frequency_mhz == 1200


def test_parse_profile_uses_source_in_errors() -> None:
    profile = parse_profile("\n".join(_valid_lines()), "inline.csv")
    assert profile.source == "inline.csv"
    assert profile.num_stages == 2
    assert profile.get(1, "backward").times_s.tolist() == [0.4, 0.4]
    with pytest.raises(ProfileError, match=r"^inline\.csv: line 1: header is missing"):
        parse_profile("stage,instruction\n", "inline.csv")


def test_byte_order_mark_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "bom.csv"
    path.write_text("\ufeff" + "\n".join(_valid_lines()), encoding="utf-8")
    assert load_profile(path).num_stages == 2


def test_get_missing_entry_raises(tmp_path: Path) -> None:
    path = _write(tmp_path, _valid_lines())
    profile = load_profile(path)
    with pytest.raises(ProfileError, match="no measurements for stage 5") as info:
        profile.get(5, "forward")
    assert str(path) in str(info.value)


def test_measurements_are_read_only(tmp_path: Path) -> None:
    profile = load_profile(_write(tmp_path, _valid_lines()))
    measured = profile.get(0, "forward")
    with pytest.raises(ValueError, match="read-only"):
        measured.times_s[0] = 1.0
    with pytest.raises(TypeError):
        profile.measurements[(9, "forward")] = measured  # type: ignore[index]


def test_measurements_reject_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="equal length"):
        Measurements(
            frequencies_mhz=np.array([1, 2], dtype=np.int64),
            times_s=np.array([1.0]),
            energies_j=np.array([1.0, 2.0]),
        )


def test_profile_get_is_case_insensitive() -> None:
    measured = Measurements(
        frequencies_mhz=np.array([2, 1], dtype=np.int64),
        times_s=np.array([1.0, 2.0]),
        energies_j=np.array([3.0, 4.0]),
    )
    profile = Profile("x", 1, {(0, "forward"): measured, (0, "backward"): measured})
    assert profile.get(0, "Forward") is measured
    assert profile.frequencies_mhz.tolist() == [2, 1]


# --------------------------------------------------------------------------- rich form


def _rich_lines() -> tuple[list[str], dict[tuple[int, str, int], tuple[float, float]]]:
    """2 pipeline stages x 2 tensor ranks x 2 data-parallel replicas, 2 clocks each.

    Returns the file lines and, per (stage, instruction, frequency), the expected aggregated
    (time, energy) over the dp_rank 0 rows.
    """
    lines = ["rank,dp_rank,pp_rank,tp_rank,instruction,frequency,time,energy,host"]
    expected: dict[tuple[int, str, int], tuple[float, float]] = {}
    for frequency_mhz in (1410, 1200):
        for instruction in WHOLE_BACKWARD:
            for pp in range(2):
                times, energies = [], []
                for tp in range(2):
                    for dp in range(2):
                        rank = dp * 4 + pp * 2 + tp
                        # Replica 1 is much slower and hungrier so including it would show.
                        time_s = 0.1 * (pp + 1) + 0.01 * tp + (1.0 if dp else 0.0)
                        time_s += 0.05 if instruction == "backward" else 0.0
                        time_s += 0.02 if frequency_mhz == 1200 else 0.0
                        energy_j = 10.0 * (pp + 1) + tp + (100.0 if dp else 0.0)
                        lines.append(
                            f"{rank},{dp},{pp},{tp},{instruction},{frequency_mhz},"
                            f"{time_s!r},{energy_j!r},node{dp}"
                        )
                        if dp == 0:
                            times.append(time_s)
                            energies.append(energy_j)
                expected[(pp, instruction, frequency_mhz)] = (max(times), energies[0] + energies[1])
    return lines, expected


def test_rich_form_aggregates_tensor_ranks_of_replica_zero(tmp_path: Path) -> None:
    lines, expected = _rich_lines()
    profile = load_profile(_write(tmp_path, lines))
    assert profile.num_stages == 2
    assert profile.frequencies_mhz.tolist() == [1410, 1200]
    for stage in range(2):
        for instruction in WHOLE_BACKWARD:
            measured = profile.get(stage, instruction)
            assert measured.frequencies_mhz.tolist() == [1410, 1200]
            for i, frequency_mhz in enumerate((1410, 1200)):
                time_s, energy_j = expected[(stage, instruction, frequency_mhz)]
                assert measured.times_s[i] == time_s
                assert measured.energies_j[i] == energy_j
    # Spot check one by hand: stage 1 forward at 1410 MHz, tp 0/1 take 0.2/0.21 s, 20/21 J.
    assert profile.get(1, "forward").times_s[0] == pytest.approx(0.21)
    assert profile.get(1, "forward").energies_j[0] == pytest.approx(41.0)


def test_rich_form_keeps_file_order(tmp_path: Path) -> None:
    lines = [
        "rank,dp_rank,pp_rank,tp_rank,instruction,frequency,time,energy",
        "0,0,0,0,forward,1000,0.5,5",
        "0,0,0,0,forward,1400,0.3,7",
        "0,0,0,0,backward,1400,0.6,9",
        "0,0,0,0,backward,1000,0.9,8",
    ]
    profile = load_profile(_write(tmp_path, lines))
    assert profile.get(0, "forward").frequencies_mhz.tolist() == [1000, 1400]
    assert profile.get(0, "backward").frequencies_mhz.tolist() == [1400, 1000]


def test_rich_form_duplicate_rank_row(tmp_path: Path) -> None:
    lines, _ = _rich_lines()
    path = _write(tmp_path, [*lines, lines[3]])
    _expect_error(path, len(lines) + 1, "duplicate row for rank", "first given on line 4")


def test_rich_form_missing_tensor_rank(tmp_path: Path) -> None:
    lines, _ = _rich_lines()
    # Line 4 is rank 2 (dp 0, pp 0, tp 1) forward at 1410 MHz.
    assert lines[3].startswith("1,0,0,1,forward,1410,")
    path = _write(tmp_path, lines[:3] + lines[4:])
    _expect_error(path, 2, "stage 0 forward at 1410 MHz", "tp_rank 1")


def test_rich_form_inconsistent_rank_coordinates(tmp_path: Path) -> None:
    lines, _ = _rich_lines()
    path = _write(tmp_path, [*lines, "0,0,1,0,forward,999,0.1,1,node0"])
    _expect_error(path, len(lines) + 1, "rank 0 has dp_rank/pp_rank/tp_rank 0/1/0", "line 2")


def test_rich_form_without_replica_zero(tmp_path: Path) -> None:
    lines = [
        "rank,dp_rank,pp_rank,tp_rank,instruction,frequency,time,energy",
        "4,1,0,0,forward,1000,0.5,5",
    ]
    _expect_error(_write(tmp_path, lines), None, "no rows with dp_rank 0")


def test_rich_form_missing_column(tmp_path: Path) -> None:
    lines = ["rank,dp_rank,pp_rank,instruction,frequency,time,energy", "0,0,0,forward,1,1,1"]
    _expect_error(_write(tmp_path, lines), 1, "missing column(s) 'tp_rank'", "accepted forms")


# --------------------------------------------------------------------------- bad input


def test_missing_file(tmp_path: Path) -> None:
    _expect_error(tmp_path / "nope.csv", None, "cannot read profile")


def test_directory_instead_of_file(tmp_path: Path) -> None:
    _expect_error(tmp_path, None, "cannot read profile")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "binary.csv"
    path.write_bytes(b"\xff\xfe\xfa")
    _expect_error(path, None, "not UTF-8")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.csv"
    path.write_text("", encoding="utf-8")
    _expect_error(path, None, "file is empty", "accepted forms")


def test_missing_header_columns(tmp_path: Path) -> None:
    path = _write(tmp_path, ["stage,instruction,frequency", "0,forward,1410"])
    _expect_error(path, 1, "missing column(s) 'time', 'energy'", "accepted forms", HEADER)


def test_duplicate_header_column(tmp_path: Path) -> None:
    path = _write(tmp_path, [HEADER + ",Time", *_valid_lines()[1:]])
    _expect_error(path, 1, "column 'time' appears more than once")


def test_header_only(tmp_path: Path) -> None:
    _expect_error(_write(tmp_path, [HEADER]), None, "no data rows", "at least one stage")


def test_wrong_number_of_fields(tmp_path: Path) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 4, "0,forward,1200,0.1"))
    _expect_error(path, 4, "expected 5 fields", "got 4")


def test_malformed_quoting(tmp_path: Path) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 3, '0,"backward"x,1410,0.3,20.5'))
    _expect_error(path, 3, "malformed CSV")


def test_missing_stage_value(tmp_path: Path) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 5, " ,backward,1200,0.3,20.5"))
    _expect_error(path, 5, "missing stage value")


def test_missing_instruction_value(tmp_path: Path) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 2, "0,,1410,0.1,10.5"))
    _expect_error(path, 2, "missing instruction value")


def test_unknown_instruction(tmp_path: Path) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 2, "0,optimizer,1410,0.1,10.5"))
    _expect_error(path, 2, "unknown instruction 'optimizer'", "forward, backward")


@pytest.mark.parametrize("stage", ["1.5", "one", "1_0"])
def test_non_integer_stage(tmp_path: Path, stage: str) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 6, f"{stage},forward,1410,0.2,11.5"))
    _expect_error(path, 6, "stage must be a non-negative integer", repr(stage))


def test_negative_stage(tmp_path: Path) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 6, "-1,forward,1410,0.2,11.5"))
    _expect_error(path, 6, "stage must be non-negative", "'-1'")


@pytest.mark.parametrize("value", ["fast", ""])
def test_non_numeric_time(tmp_path: Path, value: str) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 7, f"1,backward,1410,{value},21.5"))
    phrase = "missing time value" if not value else "time is not a number: 'fast'"
    _expect_error(path, 7, phrase)


@pytest.mark.parametrize(
    ("column", "row"), [("time", "0,forward,1410,{},10.5"), ("energy", "0,forward,1410,0.1,{}")]
)
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "Infinity"])
def test_non_finite_values(tmp_path: Path, column: str, row: str, value: str) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 2, row.format(value)))
    _expect_error(path, 2, f"{column} must be a finite number", repr(value))


def test_non_numeric_energy(tmp_path: Path) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 9, "1,backward,1200,0.4,lots"))
    _expect_error(path, 9, "energy is not a number: 'lots'")


@pytest.mark.parametrize("value", ["1410.5", "0", "-1410", "abc", "nan", "1e400"])
def test_bad_frequency(tmp_path: Path, value: str) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 3, f"0,backward,{value},0.3,20.5"))
    _expect_error(path, 3, "frequency must be a positive integer in MHz", repr(value))


def test_float_written_frequency_is_accepted(tmp_path: Path) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 2, "0,forward,1410.0,0.1,10.5"))
    assert load_profile(path).get(0, "forward").frequencies_mhz.tolist() == [1410, 1200]


@pytest.mark.parametrize("value", ["0", "0.0", "-0.1"])
def test_non_positive_time(tmp_path: Path, value: str) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 4, f"0,forward,1200,{value},10.5"))
    _expect_error(path, 4, "time must be positive (seconds)", repr(value))


@pytest.mark.parametrize("value", ["0", "-3"])
def test_non_positive_energy(tmp_path: Path, value: str) -> None:
    path = _write(tmp_path, _with_line(_valid_lines(), 4, f"0,forward,1200,0.1,{value}"))
    _expect_error(path, 4, "energy must be positive (joules)", repr(value))


def test_duplicate_row(tmp_path: Path) -> None:
    # Same (stage, instruction, frequency) as line 2 with different case and clock spelling.
    path = _write(tmp_path, [*_valid_lines(), "0,FORWARD,1410.0,0.1,10.5"])
    _expect_error(
        path, 10, "duplicate row for stage 0 forward at 1410 MHz", "first given on line 2"
    )


def test_stages_not_contiguous(tmp_path: Path) -> None:
    lines = [
        line.replace("1,", "2,", 1) if line.startswith("1,") else line for line in _valid_lines()
    ]
    _expect_error(_write(tmp_path, lines), None, "stage 1 missing", "contiguously 0..2")


def test_stages_not_starting_at_zero(tmp_path: Path) -> None:
    lines = [HEADER] + [line for line in _valid_lines()[1:] if line.startswith("1,")]
    _expect_error(_write(tmp_path, lines), None, "stage 0 missing")


def test_many_missing_stages_are_elided(tmp_path: Path) -> None:
    lines = [
        line.replace("1,", "1000000000000,", 1) if line.startswith("1,") else line
        for line in _valid_lines()
    ]
    _expect_error(_write(tmp_path, lines), None, "stages 1, 2, 3, 4, 5, ... (999999999999 in all)")


def test_stage_missing_an_instruction(tmp_path: Path) -> None:
    lines = [line for line in _valid_lines() if not line.startswith("1,backward")]
    _expect_error(_write(tmp_path, lines), None, "stage 1 has no backward rows")


def test_only_one_frequency(tmp_path: Path) -> None:
    lines = _valid_lines()
    assert lines[8] == "1,backward,1200,0.40,21.5"
    path = _write(tmp_path, lines[:8])
    _expect_error(
        path, 7, "stage 1 backward has only one frequency (1410 MHz)", "profile at least two clocks"
    )


# --------------------------------------------------------------------------- errors module


def test_profile_error_attributes_and_pickling() -> None:
    error = ProfileError("a.csv", "bad thing", 7)
    assert str(error) == "a.csv: line 7: bad thing"
    assert (error.source, error.row, error.problem) == ("a.csv", 7, "bad thing")
    assert str(ProfileError("a.csv", "bad thing")) == "a.csv: bad thing"
    assert isinstance(error, ApiError)
    assert isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error)
    assert (copy.source, copy.row, copy.problem) == ("a.csv", 7, "bad thing")


# --------------------------------------------------------------------------- planner limits


@pytest.mark.parametrize("energy", ["1e9", "1e300", "1.7e308"])
def test_energy_beyond_what_the_planner_counts_is_refused_at_its_line(
    tmp_path: Path, energy: str
) -> None:
    lines = _with_line(_valid_lines(), 3, f"0,backward,1410,0.30,{energy}")
    error = _expect_error(_write(tmp_path, lines), 3, f"energy {energy} J is above", "7.04e+07 J")
    assert "micro-joules" in str(error)


def test_rich_form_energy_limit_names_the_line(tmp_path: Path) -> None:
    lines, _ = _rich_lines()
    fields = lines[4].split(",")
    fields[7] = "1e300"
    lines[4] = ",".join(fields)
    _expect_error(_write(tmp_path, lines), 5, "energy 1e300 J is above")
