"""One engine process for the shared-Redis tests: generate greedy continuations of the given
prompts with the given tier config, wait for the tier saves, print outputs and stats as JSON."""

from __future__ import annotations

import dataclasses
import json
import sys


def main() -> None:
    model, tier_config, prompts_json, pool_bytes = sys.argv[1:5]
    from kvserve import LLM, SamplingParams

    prompts = json.loads(prompts_json)
    llm = LLM(model=model, dtype="float32", max_model_len=512, kv_tier_config=tier_config,
              kv_cache_memory_bytes=int(pool_bytes), num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.engine
    engine.tiers.flush()
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                      "stats": dataclasses.asdict(engine.stats()), "tiers": engine.tier_stats()}))
    engine.shutdown()


if __name__ == "__main__":
    main()
