"""Test machinery: all-reduces counted in this process. `count_all_reduces(module, ...)`
wraps each module's `all_reduce` (the trainers call it through the module, so the module
attribute is what counts); `all_reduces[0]` is the count so far."""

all_reduces = [0]


def _counting(all_reduce):
    def counted_all_reduce(*args, **kwargs):
        all_reduces[0] += 1
        return all_reduce(*args, **kwargs)

    return counted_all_reduce


def count_all_reduces(*modules) -> None:
    for module in modules:
        module.all_reduce = _counting(module.all_reduce)
