"""How many blocks a sequence holds, at each point of its life: block arithmetic over the block
size and each KV group's window, apart from the manager (kv/manager.py) that allocates them.

The manager inherits it; admission, the input processor's "can this request ever fit" check,
the start-up capacity line and `kvserve plan` all count blocks here, so they cannot disagree.
"""

from __future__ import annotations

from typing import Any

from kvserve.kv.spec import first_needed_block


class BlockCounts:
    """Needs `block_size` and `groups` (each with its `window`: None keeps every block)."""

    block_size: int
    groups: list[Any]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_held_block(self, num_computed: int, group: int = 0) -> int:
        """The first block a sequence that has computed `num_computed` tokens still needs in
        a group: the one holding the first key its next query sees (0 without a window)."""
        return first_needed_block(num_computed, self.groups[group].window, self.block_size)

    def blocks_held(self, num_computed: int, num_tokens: int, group: int = 0) -> int:
        """Blocks a sequence holds at once in a group when it has computed `num_computed`
        tokens and has room for `num_tokens`: the window's blocks and the new ones."""
        return self.blocks_for_tokens(num_tokens) - self.first_held_block(num_computed,
                                                                          group=group)

    def group_final_blocks(self, total_tokens: int) -> list[int]:
        """Per group, the blocks a sequence holds when it computes its last token: its window
        and the block being filled (every block without a window)."""
        n = self.blocks_for_tokens(total_tokens)
        return [min(n, self.blocks_held(max(total_tokens - 1, 0), total_tokens, g))
                for g in range(len(self.groups))]

    def final_blocks(self, total_tokens: int) -> int:
        """Blocks a sequence holds when it computes its last token, every group together (the
        start-up line's and `kvserve plan`'s figure, up to one block per group)."""
        return sum(self.group_final_blocks(total_tokens))

    def peak_blocks(self, prompt_tokens: int, total_tokens: int) -> int:
        """The most blocks a sequence holds at once in its life, as admission counts them: per
        group, its whole prompt (prefilled in one step at worst), or what it holds at the end."""
        prompt = self.blocks_for_tokens(prompt_tokens)
        return sum(max(prompt, f) for f in self.group_final_blocks(total_tokens))
