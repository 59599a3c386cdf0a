"""Short constructors for schedule actions, shared by the schedule tests."""

from triax.pipeline.ir import Action


def F(j, c):
  return Action('F', j, c)


def B(j, c):
  return Action('B', j, c)


def W(j, c):
  return Action('W', j, c)
