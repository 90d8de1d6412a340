"""The algorithm maths: pure functions over masked tensors, selectable by name."""
