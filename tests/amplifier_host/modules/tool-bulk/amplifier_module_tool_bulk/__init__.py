"""A tool with a large output for the real-CLI tests: ``bulk`` returns ``words`` words of varied English
prose, the same for the same ``seed``, so a session's history grows many times a small context window in a
few turns."""

from __future__ import annotations

import random
from typing import Any

from amplifier_core import ToolResult

__amplifier_module_type__ = "tool"

#: Common words of different lengths, so the prose tokenises like ordinary text (about 1.1 cl100k tokens a word).
WORDS = ("the of and to in is that for it as with was on be by at this have from or one had not but what all "
         "were when we there can an your which their said if do will each about how up out them then she many "
         "some so these would other into has more her two like him see time could no make than first been its "
         "who now people my made over did down only way find use may water long little very after words called "
         "just where most know get through back much before go good new write our used me man too any day same "
         "right look think also around another came come work three word must because does part even place well "
         "such here take why things help put years different away again off went old number great tell men say "
         "small every found still between name should home big give air line set own under read last never us "
         "left end along while might next sound below saw something thought both few those always looked show "
         "large often together asked house world going want school important until form food keep children feet "
         "land side without boy once animals life enough took sometimes four head above kind began almost live "
         "page got earth need far hand high year mother light parts country father let night following picture "
         "being study second eyes soon times story boys since white days ever paper hard near sentence better "
         "best across during today others however sure means knew try told young miles sun ways thing whole hear "
         "example heard several change answer room sea against top turned learn point city play toward five "
         "using himself usually").split()


def prose(words: int, seed: int) -> str:
    rng = random.Random(seed)
    out = []
    for i in range(words):
        word = rng.choice(WORDS)
        out.append(word.capitalize() if i % 12 == 0 else word)
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


class Bulk:
    name = "bulk"
    description = "Return a report of the given number of words."
    input_schema = {"type": "object", "properties": {"words": {"type": "integer"}, "seed": {"type": "integer"}},
                    "required": ["words", "seed"]}

    async def execute(self, input: dict[str, Any]) -> ToolResult:
        return ToolResult(success=True, output=prose(int(input["words"]), int(input["seed"])))


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> None:
    await coordinator.mount("tools", Bulk(), name="bulk")
