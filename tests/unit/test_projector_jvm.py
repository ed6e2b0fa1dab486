"""The projector's JVM options follow its live paths' mode unless set
(`Settings.projector_jvm_options`)."""

from __future__ import annotations

import pytest

from config.settings import Settings


@pytest.fixture(autouse=True)
def unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOGFOLD_PROJECTOR_JAVA_OPTIONS", "LOGFOLD_SPARK_REALTIME"):
        monkeypatch.delenv(name, raising=False)


def test_real_time_mode_compiles_with_both_jit_compilers() -> None:
    assert Settings().projector_jvm_options() == ""


def test_micro_batches_compile_with_the_quick_compiler_alone_and_tiers_code_cache() -> None:
    # Alone, C1 would get a 48 MiB code cache, which a rebuild in the projector filled.
    options = Settings(spark_realtime=False).projector_jvm_options().split()
    assert options == ["-XX:TieredStopAtLevel=1", "-XX:ReservedCodeCacheSize=240m"]


def test_options_set_win_whatever_the_mode() -> None:
    assert Settings(spark_realtime=False, projector_java_options="").projector_jvm_options() == ""
    assert Settings(projector_java_options="-Xss4m").projector_jvm_options() == "-Xss4m"


def test_options_set_empty_in_the_environment_mean_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOGFOLD_SPARK_REALTIME", "false")
    monkeypatch.setenv("LOGFOLD_PROJECTOR_JAVA_OPTIONS", "")
    assert Settings().projector_jvm_options() == ""
