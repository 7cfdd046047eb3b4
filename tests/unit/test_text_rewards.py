"""The answer-tag and multiple-choice verifiers against hand-decided verdicts."""

import time

import pytest

from asyncrl.reward.text_rewards import AnswerTagReward, MultipleChoiceReward, normalize_answer

TAG_OUTCOMES = {"exact", "normalized", "wrong", "no_answer_tag", "no_ground_truth", "bad_input"}
CHOICE_OUTCOMES = {"correct", "wrong", "no_choice", "no_ground_truth", "bad_gold", "bad_input"}


def case(response, gold, reward, outcome, id):
    return pytest.param(response, gold, reward, outcome, id=id)


ANSWER_TAG = [
    case("<answer>42</answer>", "42", 1, "exact", "plain"),
    case("<answer>\n  42 \n</answer>", "42", 1, "exact", "surrounding-whitespace-is-exact"),
    case("<think>maybe <answer>41</answer></think> so <answer>42</answer>", "42", 1, "exact",
         "after-think"),
    case("<think>I guess <answer>42</answer></think> I give up", "42", 0, "no_answer_tag",
         "tag-only-inside-reasoning"),
    case("<think>still thinking <answer>42</answer>", "42", 0, "no_answer_tag", "think-never-closed"),
    case("<answer>41</answer> no wait <answer>42</answer>", "42", 1, "exact", "last-tag-counts"),
    case("<answer>42</answer> no wait <answer>41</answer>", "42", 0, "wrong", "last-tag-wrong"),
    case("<answer>Paris</answer>", "paris", 1, "normalized", "case-fold"),
    case("<answer>Paris.</answer>", "Paris", 1, "normalized", "trailing-period"),
    case("<answer>New   York\nCity</answer>", "new york city", 1, "normalized", "inner-whitespace"),
    case("<answer>$x+1$</answer>", "x+1", 1, "normalized", "dollars"),
    case("<answer>$$7$$</answer>", "7", 1, "normalized", "double-dollars"),
    case(r"<answer>\text{Blue}</answer>", "blue", 1, "normalized", "text-wrapper"),
    case(r"<answer>$\text{Paris}$.</answer>", "Paris", 1, "normalized", "dollars-text-period"),
    case("<answer>1,000</answer>", "1000", 1, "normalized", "thousands-separator"),
    case("<answer>-12,345.5</answer>", "-12345.5", 1, "normalized", "signed-decimal-thousands"),
    case("<answer>1,000</answer>", 1000, 1, "normalized", "integer-gold"),
    case("<answer>1,2</answer>", "12", 0, "wrong", "list-is-not-a-number"),
    case("<answer>1,000 apples</answer>", "1000 apples", 0, "wrong", "comma-kept-inside-text"),
    case("<answer>5!</answer>", "5", 0, "wrong", "factorial-is-not-punctuation"),
    case("<answer>3, 1, 2</answer>", "3,1,2", 0, "wrong", "spacing-inside-list-matters"),
    case(r"<answer>\text{a} and \text{b}</answer>", "a} and \\text{b", 0, "wrong",
         "text-wrapper-must-span-whole"),
    case("<answer></answer>", "42", 0, "wrong", "empty-tag"),
    case("<answer>42", "42", 0, "no_answer_tag", "never-closed"),
    case("The answer is 42.", "42", 0, "no_answer_tag", "no-tag"),
    case("<ANSWER>42</ANSWER>", "42", 0, "no_answer_tag", "upper-case-tags-not-accepted"),
    case("<answer>42</answer>", ["41", "42"], 1, "exact", "any-of-a-list"),
    case("<answer>42</answer>", None, 0, "no_ground_truth", "gold-none"),
    case("<answer>42</answer>", "  ", 0, "no_ground_truth", "gold-blank"),
    case("<answer>42</answer>", [], 0, "no_ground_truth", "gold-empty-list"),
    case("<answer>42</answer>", {"x": 1}, 0, "bad_input", "gold-dict"),
    case("<answer>True</answer>", True, 0, "bad_input", "gold-bool"),
    case("", "42", 0, "no_answer_tag", "empty-response"),
    case("<answer>4\udcff2</answer>", "42", 0, "wrong", "lone-surrogate"),
]


@pytest.mark.parametrize("response,gold,reward,outcome", ANSWER_TAG)
def test_answer_tag(response, gold, reward, outcome):
    got, info = AnswerTagReward()(response, {"answer": gold})
    assert (got, info["outcome"]) == (reward, outcome)
    assert info["outcome"] in TAG_OUTCOMES


def test_answer_tag_without_normalization_needs_exact():
    verifier = AnswerTagReward(normalize=False)
    assert verifier("<answer> Paris </answer>", {"answer": "Paris"}) == (1.0, {"answer": "Paris",
                                                                             "outcome": "exact"})
    assert verifier("<answer>paris</answer>", {"answer": "Paris"})[1]["outcome"] == "wrong"


def test_answer_tag_info_is_cut_and_encodable():
    _, info = AnswerTagReward()("<answer>\udcff" + "x" * 10_000 + "</answer>", {"answer": "x"})
    assert len(info["answer"]) == 200
    info["answer"].encode("utf-8")


@pytest.mark.parametrize("response,metadata", [
    (None, {"answer": "1"}), (b"<answer>1</answer>", {"answer": "1"}),
    ("<answer>1</answer>", None), ("<answer>1</answer>", "1"),
])
def test_answer_tag_wrong_types(response, metadata):
    assert AnswerTagReward()(response, metadata) == (0.0, {"outcome": "bad_input"})


@pytest.mark.parametrize("text,key", [("  $1,234,567$. ", "1234567"), (r"\textbf{Yes}", "yes"),
                                      (r"\text{$5$}", "5"), ("A  b\tC", "a b c"), ("12,34", "12,34")])
def test_normalize_answer(text, key):
    assert normalize_answer(text) == key


MULTIPLE_CHOICE = [
    case("<answer>B</answer>", "B", 1, "correct", "tag"),
    case("<answer>b</answer>", "B", 1, "correct", "tag-lower-case"),
    case("<answer>(C)</answer>", "c", 1, "correct", "tag-parenthesized-lower-gold"),
    case("<answer>D. 42 kg</answer>", "D", 1, "correct", "tag-letter-with-text"),
    case("<answer>Option A</answer>", "A", 1, "correct", "tag-option-prefix"),
    case("<answer>B</answer>", "(B)", 1, "correct", "gold-parenthesized"),
    case("<answer>B</answer>", "B.", 1, "correct", "gold-period"),
    case("<answer>B</answer>", "B) Mitochondria", 1, "correct", "gold-with-text"),
    case("<answer>A</answer>", "B", 0, "wrong", "tag-wrong"),
    case("<answer>B</answer> answer is C", "C", 0, "wrong", "tag-beats-phrase"),
    case("<answer>Because</answer>", "B", 0, "no_choice", "tag-word-is-no-choice"),
    case("<answer>K</answer>", "B", 0, "no_choice", "letter-out-of-range"),
    case(r"so \boxed{E}", "E", 1, "correct", "boxed"),
    case(r"\boxed{A} no, \boxed{\text{(F)}}", "F", 1, "correct", "last-box-with-text"),
    case(r"\boxed{E} and the answer is A", "A", 0, "wrong", "box-beats-phrase"),
    case("Therefore, the answer is (D).", "D", 1, "correct", "answer-is-parens"),
    case("the answer is (d)", "D", 1, "correct", "answer-is-parens-lower"),
    case("Answer: J", "J", 1, "correct", "answer-colon"),
    case("The final answer is: **G**", "G", 1, "correct", "answer-bold"),
    case("answer is A, no wait, the answer is C.", "C", 1, "correct", "last-phrase-counts"),
    case("the answer is a bit subtle", "A", 0, "no_choice", "lower-case-word-is-no-choice"),
    case("The answer is Ab initio", "A", 0, "no_choice", "letter-starting-a-word"),
    case("I pick B", "B", 0, "no_choice", "no-marker"),
    case("<think>answer is B</think> I am unsure", "B", 0, "no_choice", "only-in-reasoning"),
    case("<think>answer is B", "B", 0, "no_choice", "think-never-closed"),
    case("<think>hmm</think>Answer: H", "H", 1, "correct", "after-think"),
    case("", "B", 0, "no_choice", "empty-response"),
    case("\udcff answer is B \udcff", "B", 1, "correct", "lone-surrogates-around"),
    case("<answer>B</answer>", None, 0, "no_ground_truth", "gold-none"),
    case("<answer>B</answer>", "", 0, "no_ground_truth", "gold-empty"),
    case("<answer>B</answer>", "Mitochondria", 0, "bad_gold", "gold-not-a-letter"),
    case("<answer>B</answer>", "K", 0, "bad_gold", "gold-out-of-range"),
    case("<answer>B</answer>", 2, 0, "bad_gold", "gold-index"),
    case("<answer>B</answer>", ["A", "B"], 0, "bad_gold", "gold-list"),
]


@pytest.mark.parametrize("response,gold,reward,outcome", MULTIPLE_CHOICE)
def test_multiple_choice(response, gold, reward, outcome):
    got, info = MultipleChoiceReward()(response, {"answer": gold})
    assert (got, info["outcome"]) == (reward, outcome)
    assert info["outcome"] in CHOICE_OUTCOMES


def test_multiple_choice_reports_choice():
    assert MultipleChoiceReward()("Answer: (e)", {"answer": "C"}) == (
        0.0, {"choice": "E", "outcome": "wrong"})


@pytest.mark.parametrize("response,metadata", [(None, {"answer": "B"}), ("Answer: B", None)])
def test_multiple_choice_wrong_types(response, metadata):
    assert MultipleChoiceReward()(response, metadata) == (0.0, {"outcome": "bad_input"})


ADVERSARIAL = {
    "spaces-after-answer": "answer" + " " * 1_000_000 + "x",
    "many-answer-phrases": "answer is " * 100_000,
    "open-tags": "<answer>" * 100_000,
    "open-braces": "\\boxed{" + "{" * 1_000_000,
    "open-boxes": "\\boxed{" * 100_000,
    "dollars": "$" * 1_000_000,
    "text-wrappers-in-tag": "<answer>" + "\\text{" * 100_000 + "</answer>",
    "answers-no-letter": "Answer: " * 100_000,
    "thinks": "<think>" * 100_000 + "</think>" + "x" * 300_000,
}


@pytest.mark.parametrize("verifier", [AnswerTagReward(), MultipleChoiceReward()], ids=["tag", "choice"])
@pytest.mark.parametrize("response", list(ADVERSARIAL.values()), ids=list(ADVERSARIAL))
def test_megabyte_responses_are_linear(verifier, response):
    start = time.perf_counter()
    reward, info = verifier(response, {"answer": "B"})
    assert reward == 0.0 and info["outcome"] in TAG_OUTCOMES | CHOICE_OUTCOMES
    assert time.perf_counter() - start < 2.0  # ~0.1 s; a quadratic scan would take minutes
