"""The config source of `correction=a+b+c` and the search-path plugin that puts it on every app's path."""
from __future__ import annotations

from typing import List, Optional

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

GROUP = "correction"
SCHEME = "rlmm-stack"


def stage_names(option: str) -> list[str] | None:
    """The stages of a stacked option (`a+b+c` -> [a, b, c]); None for an option that is not a stack."""
    return option.split("+") if "+" in option else None


def stack_problem(option: str, options: list[str]) -> str | None:
    """Why `correction=<option>` is not a stack of `options` (one line), or None when it is one."""
    stages = stage_names(option)
    if stages is None:
        return None
    if any(not stage for stage in stages):
        return f"correction={option}: an empty stage (write stages between '+', e.g. correction=icepop+tis)"
    unknown = [stage for stage in stages if stage not in options]
    if unknown:
        return f"correction={option}: unknown stage '{unknown[0]}' (allowed: {', '.join(options)})"
    twice = sorted({stage for stage in stages if stages.count(stage) > 1})
    if twice:
        return f"correction={option}: stage '{twice[0]}' is listed twice"
    return None


class StackedCorrections(ConfigSource):
    """`correction/a+b+c`: conf/correction/'s a, b and c composed into one Stack (see the package docstring)."""

    @staticmethod
    def scheme() -> str:
        return SCHEME

    @staticmethod
    def _conf_dir():
        from rlmm.config.options import CONF_DIR  # imports neither torch nor Hydra's app

        return CONF_DIR

    def _options(self) -> list[str]:
        from rlmm.config.options import group_options

        return group_options(GROUP)

    @staticmethod
    def _option(config_path: str) -> str | None:
        group, _, name = config_path.removesuffix(".yaml").rpartition("/")
        return name if group == GROUP and "+" in name else None

    def available(self) -> bool:
        return True

    def is_group(self, config_path: str) -> bool:
        return False  # the group's listing stays conf/correction/'s; a stack is found by name only

    def is_config(self, config_path: str) -> bool:
        return self._option(config_path) is not None

    def load_config(self, config_path: str) -> ConfigResult:
        from rlmm.config.options import option_node

        option = self._option(config_path)
        problem = stack_problem(option or "", self._options()) if option else f"not a stack: {config_path}"
        if problem:
            raise ConfigLoadError(problem)
        stages = {stage: option_node(GROUP, stage) for stage in stage_names(option)}
        config = OmegaConf.create({"_target_": "rlmm.corrections.stack.Stack", "stages": stages})
        return ConfigResult(config=config, path=f"{SCHEME}://{self.path}", provider=self.provider,
                            header={"package": None})

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        return []


class StackSearchPath(SearchPathPlugin):
    """Puts `StackedCorrections` on the search path of every Hydra app (it answers only for `correction/a+b`)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="rlmm-stack", path=f"{SCHEME}://{GROUP}")
