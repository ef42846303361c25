"""Train a small CNN on scikit-learn's digits with segflow (forward + backward + SGD).

Usage::

    python examples/train_digits.py [--epochs 12] [--optimizer sgd|adam] [--explain]

Same as ``segflow train-demo``; see :mod:`segflow.training_demo` for the model.
"""

from segflow.training_demo import main

if __name__ == "__main__":
    raise SystemExit(main())
