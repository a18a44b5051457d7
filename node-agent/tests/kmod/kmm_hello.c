// SPDX-License-Identifier: GPL-2.0
/*
 * kmm_hello: the sample out-of-tree module of the kmm-fleet local fleet. It exports
 * one symbol so that kmm_hello_dep has a real dependency for modules.dep/modprobe.
 */
#include <linux/init.h>
#include <linux/module.h>

int kmm_hello_greet(const char *who)
{
	pr_info("kmm_hello: hello, %s\n", who);
	return 0;
}
EXPORT_SYMBOL_GPL(kmm_hello_greet);

static int __init kmm_hello_init(void)
{
	pr_info("kmm_hello: loaded\n");
	return 0;
}

static void __exit kmm_hello_exit(void)
{
	pr_info("kmm_hello: unloaded\n");
}

module_init(kmm_hello_init);
module_exit(kmm_hello_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kmm-fleet sample module");
MODULE_VERSION("1.0");
