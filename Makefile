# The two commands a newcomer needs (see README.md).
.PHONY: demo test
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
