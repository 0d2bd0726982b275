"""Branch and judge: fork a conversation into candidate answers, then let the model pick
the best with ``select``, in radixlm's DSL.

    .venv/bin/python examples/dsl_branch_and_judge.py                # starts its own server
    .venv/bin/python examples/dsl_branch_and_judge.py --url http://127.0.0.1:30000

1. ``s.fork(n)`` makes n branches of the conversation; the shared prefix is computed
   once and every branch reuses it (each branch's ``cached_tokens`` > 0);
2. each branch samples one candidate (temperature 0.8, its own seed), all at once;
3. ``join()`` gathers the candidates; the judge turn lists them and ``select``s one,
   scoring each option by its tokens' mean logprob (per-option scores are printed).
"""

from __future__ import annotations

import argparse

from dsl_backend import add_backend_args, backend_from_args

from radixlm.frontend import (
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    select,
    system,
    user,
)


@function
def branch_and_judge(s, task, n):
    s += system("You are a creative and concise assistant.")
    s += user(task)
    branches = s.fork(n)
    for i, branch in enumerate(branches):
        branch += assistant(gen("candidate", max_tokens=16, temperature=0.8, seed=i, stop="\n"))
    branches.join()
    candidates = [c.strip() or "(empty)" for c in s["candidate"]]
    listing = "\n".join(f"{i + 1}. {c}" for i, c in enumerate(candidates))
    s += assistant(f"I have {n} ideas.")
    s += user(f"Here are {n} candidates:\n{listing}\nWhich one is the best? Reply with its text.")
    s += assistant_begin()
    s += select("best", candidates)
    s += assistant_end()
    return [b.get_meta_info("candidate") for b in branches]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_args(parser)
    parser.add_argument("--task", default="Suggest a name for a small bakery by the sea.")
    parser.add_argument("-n", type=int, default=4, help="branches")
    args = parser.parse_args()
    state = branch_and_judge.run(task=args.task, n=args.n, backend=backend_from_args(args))
    scores = state.get_meta_info("best")["scores"]
    for i, (candidate, meta) in enumerate(zip(state["candidate"], state.ret_value, strict=True)):
        print(f"branch {i}: {candidate!r} prompt_tokens={meta['prompt_tokens']} "
              f"cached_tokens={meta['cached_tokens']} judge_score={scores[i]:.3f}")
    print(f"best: {state['best']!r}")


if __name__ == "__main__":
    main()
