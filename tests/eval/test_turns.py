from draftlab.data.benchmarks import Question
from draftlab.decoding.engine import GenerationConfig
from draftlab.eval.turns import answer_question
from draftlab.methods.prompt_lookup import PromptLookupDrafter


def test_second_turn_sees_the_models_own_first_answer(tiny_target):
    q = Question(question_id=1, category="writing", turns=["Write a haiku about rain.", "Now make it rhyme."])
    cfg = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
    ar = answer_question(tiny_target, q, cfg=cfg)
    assert len(ar) == 2
    second_prompt = tiny_target.tokenizer.decode(ar[1].prompt_ids)
    assert ar[0].text in second_prompt and "Now make it rhyme." in second_prompt
    assert ar[1].prompt_ids[: len(ar[0].prompt_ids)] == ar[0].prompt_ids
    # a speculative method reproduces the same two-turn conversation at T=0
    spec = answer_question(tiny_target, q, drafter=PromptLookupDrafter(4), cfg=cfg)
    assert [a.tokens for a in spec] == [a.tokens for a in ar]
