"""Extract structured records from free text with a JSON schema, in radixlm's DSL.

    .venv/bin/python examples/dsl_json_extraction.py                 # starts its own server
    .venv/bin/python examples/dsl_json_extraction.py --url http://127.0.0.1:30000

For each text, one program asks the model for a JSON object and generates it with
``gen(json_schema=SCHEMA)``: the server constrains decoding to the schema, so the output
parses. The programs run as a batch (``run_batch``, all at once). Each output is parsed and validated against the schema (``jsonschema``); the script
exits non-zero if any is invalid.
"""

from __future__ import annotations

import argparse
import json
import sys

import jsonschema
from dsl_backend import add_backend_args, backend_from_args

from radixlm.frontend import assistant, function, gen, system, user

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
TEXTS = [
    "Maria Lopez is 34 years old and has lived in Madrid since she moved there for work.",
    "At 71, retired teacher John Baker still cycles around Oxford every morning.",
    "The youngest player in the club, 12-year-old Aiko Tanaka, trains in Osaka.",
]


@function
def extract(s, text):
    s += system("You extract facts from text and reply with JSON only.")
    s += user("Extract the person's name, age and city as a JSON object with the keys "
              f"name, age and city.\n\nText: {text}")
    s += assistant(gen("record", max_tokens=64, json_schema=json.dumps(SCHEMA)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_args(parser)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    backend = backend_from_args(args)
    states = extract.run_batch([{"text": t} for t in TEXTS], backend=backend, num_threads=len(TEXTS),
                               temperature=args.temperature)
    invalid = 0
    for text, state in zip(TEXTS, states, strict=True):
        meta = state.get_meta_info("record")
        try:
            record = json.loads(state["record"])
            jsonschema.validate(record, SCHEMA)
            verdict = f"valid {record}"
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid += 1
            verdict = f"INVALID ({type(exc).__name__}): {state['record']!r}"
        print(f"text: {text}\n  -> {verdict} prompt_tokens={meta['prompt_tokens']} "
              f"cached_tokens={meta['cached_tokens']}")
    print(f"summary: {len(TEXTS) - invalid}/{len(TEXTS)} valid")
    return 1 if invalid else 0


if __name__ == "__main__":
    sys.exit(main())
