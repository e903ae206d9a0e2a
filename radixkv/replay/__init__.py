"""`radixkv replay`: trace formats (`workload`), the client processes (`client`), the run
(`runner`), reports (`report`), the offline optimum (`optimum`) and the in-process simulator
(`simulate`). The service never imports this package."""
