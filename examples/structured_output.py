"""Structured output with ContinuousBatcher on the default model (SmolLM2-135M-Instruct): JSON that fits a schema.

Each request carries a ``StructuredOutput``; the engine compiles it once with xgrammar (``pip install
'hf_paged[structured]'``) and, at every step, gives -inf to the tokens that cannot continue a valid output. So even
a 135M model answers with JSON that parses and has every required field of the right type, and a multiple-choice
question gets one of its choices exactly. A plain request runs beside them, unconstrained.

Run: python examples/structured_output.py  (add --model PATH for another model; ~15 s on a laptop CPU)
"""

import argparse
import json

from hf_paged import ContinuousBatcher, SamplingParams, StructuredOutput, load_model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number"},
        "is_capital": {"type": "boolean"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "is_capital", "landmarks"],
}
TYPES = {"string": str, "number": (int, float), "boolean": bool, "array": list}


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    engine = ContinuousBatcher(model, tokenizer, num_blocks=128, block_size=16)
    greedy = dict(max_new_tokens=args.max_new_tokens, temperature=0.0)
    requests = [
        (ask(f"Describe Paris as a JSON object with the fields {', '.join(SCHEMA['properties'])}."),
         SamplingParams(**greedy, structured_output=StructuredOutput(json=SCHEMA))),
        (ask("Is Paris the capital of France? Answer yes or no."),
         SamplingParams(**greedy, structured_output=StructuredOutput(choice=["yes", "no"]))),
        (ask("Describe Paris in one sentence."), SamplingParams(max_new_tokens=32, temperature=0.0)),
    ]  # fmt: skip
    outputs = engine.generate([prompt for prompt, _ in requests], [params for _, params in requests], use_tqdm=False)
    record_output, choice_output, plain_output = (o.outputs[0] for o in outputs)

    record = json.loads(record_output.text)  # always parses: the grammar allowed nothing else
    print("json:", json.dumps(record, ensure_ascii=False))
    for name, spec in SCHEMA["properties"].items():
        if not isinstance(record[name], TYPES[spec["type"]]):
            raise SystemExit(f"field {name!r} is not a {spec['type']}: {record[name]!r}")
    print(f"matches the schema: {len(record)} fields, finish_reason {record_output.finish_reason}")
    print(f"choice: {choice_output.text!r} ({choice_output.finish_reason})")
    print(f"unconstrained: {plain_output.text.strip()!r}")


if __name__ == "__main__":
    main()
