"""Prose that cannot drift: a README.md, WORKSPACE.md or docs/design/ paragraph that names
a benchmark's doc (docs/bench_*.md, which a script writes) quotes only
figures that doc holds. A figure is a decimal (12.6), a percentage (6.9%)
or a ratio (1.07x); counts and sizes (8 devices, 2048 positions) are not
checked. A paragraph is a block between blank lines, or one list item."""

import glob
import os
import re

import pytest

pytestmark = pytest.mark.fast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURE = re.compile(r'(?<![\w.\-/:])(\d+(?:\.\d+)?%|\d+(?:\.\d+)?x(?!\w)|\d[\d,]*\.\d+(?![\d.]))')
DOC = re.compile(r'docs/(bench_\w+\.md)')


def paragraphs(text: str) -> list[str]:
  """Blocks between blank lines, list items apart; fenced code left out."""
  text = re.sub(r'```.*?```', '', text, flags=re.S)
  out = []
  for block in re.split(r'\n\s*\n', text):
    out += re.split(r'\n(?=\s*[*-] )', block)
  return out


def unquoted(paragraph: str) -> list[str]:
  """The paragraph's figures that none of the docs it names holds."""
  docs = sorted(set(DOC.findall(paragraph)))
  if not docs:
    return []
  held = ''
  for doc in docs:
    with open(os.path.join(ROOT, 'docs', doc), encoding='utf-8') as f:
      held += f.read()
  # A ratio may stand bare in a table column (1.04 under 'ratio') and with its x in prose.
  return [f for f in FIGURE.findall(paragraph) if f not in held and f.rstrip('x') not in held]


DESIGN_NOTES = sorted(
  os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(ROOT, 'docs', 'design', '*.md'))
)


@pytest.mark.parametrize('name', ['README.md', 'WORKSPACE.md', *DESIGN_NOTES])
def test_figures_quoted_beside_a_benchmark_doc_are_in_that_doc(name):
  with open(os.path.join(ROOT, name), encoding='utf-8') as f:
    text = f.read()
  drifted = [
    f'{figs} not in {DOC.findall(p)}: {" ".join(p.split())[:100]}...'
    for p in paragraphs(text)
    if (figs := unquoted(p))
  ]
  assert not drifted, '\n'.join(drifted)


def test_the_check_catches_a_figure_its_doc_lacks():
  assert unquoted('see docs/bench_planner.md: MAPE 99.9% over 9.75x') == ['99.9%', '9.75x']
  assert unquoted('no doc named: 99.9%') == []
