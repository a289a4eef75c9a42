// The prompt's warnings, as the CLI writes them (unet/cli/checks.py world_warnings), from model/live.json: a
// scenes-64 model's as unet/world.py prompt_warnings (unknown words, counts above four), any other model's the
// words its training captions never used. tests/test_live_page.py checks both against Python's, prompt by prompt.

function pyRepr(w) {  // Python's repr of a str of printable characters: '...', or "..." around a lone '
  const quote = w.includes("'") && !w.includes('"') ? '"' : "'";
  return quote + w.replace(/\\/g, "\\\\").replaceAll(quote, `\\${quote}`) + quote;
}
const pyList = (words) => `[${words.map(pyRepr).join(", ")}]`;  // as Python prints a list of words
const wordOnly = (w) => w.replace(/[^\p{L}\p{N}_-]/gu, "");  // Python's re.sub(r"[^\w-]", "", w)

// unet/world.py prompt_warnings, with its world's words W (live.json's world_words)
function worldWarnings(prompt, W) {
  const words = prompt.toLowerCase().split(/\s+/).filter((w) => w.length > 0).map(wordOnly);
  const known = new Set(W.known), above = new Set(W.counts_above);
  const tooMany = words.filter((w) => above.has(w) || (/^[0-9]+$/.test(w) && Number(w) > W.max_objects));
  const unknown = words.filter((w) => w && !known.has(w) && !tooMany.includes(w));
  const warnings = [];
  if (unknown.length) warnings.push(`unknown words ${pyList(unknown)}: ${W.knows}`);
  if (tooMany.length) {
    warnings.push(`counts above ${W.max_count_word} ${pyList(tooMany)}: this world draws one to ${W.max_count_word} ` +
                  `objects of a kind and at most ${W.max_objects} in an image`);
  } else {
    const total = words.reduce((sum, w) => sum + (Object.hasOwn(W.numerals, w) ? W.numerals[w] : 0), 0);
    if (total > W.max_objects) {
      warnings.push(`the prompt asks for ${total} objects: this world draws at most ${W.max_objects} in an image`);
    }
  }
  return warnings;
}

// `words`: the prompt's whitespace words; `live`: model/live.json
export function promptWarnings(prompt, words, live) {
  if (live.world === "scenes-64") return worldWarnings(prompt, live.world_words);
  // unet/cli/checks.py unseen_words: Python's re.sub(r"\W", "", w.lower()) keeps letters, digits and underscores
  const trained = live.trained_words && new Set(live.trained_words);
  const unseen = trained ? words.filter((w) => !trained.has(w.toLowerCase().replace(/[^\p{L}\p{N}_]/gu, ""))) : [];
  if (!unseen.length) return [];
  return [`the model never saw these words in training: ${pyList(unseen)}; their maps show what an untrained ` +
          "embedding attracts"];
}
