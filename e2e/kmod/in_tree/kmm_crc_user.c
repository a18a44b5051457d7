// SPDX-License-Identifier: GPL-2.0
/*
 * kmm_crc_user: depends on an in-tree module, crc-itu-t, through crc_itu_t(). Its image
 * does not carry crc-itu-t.ko: modprobe finds it in the node's own module tree through
 * upstream's in-tree dependency link, so the kernel must load crc_itu_t first.
 */
#include <linux/crc-itu-t.h>
#include <linux/init.h>
#include <linux/module.h>

static int __init kmm_crc_user_init(void)
{
	static const u8 data[] = "kmm-fleet";

	pr_info("kmm_crc_user: crc-itu-t of \"%s\" is 0x%04x\n", data,
		crc_itu_t(0, data, sizeof(data) - 1));
	return 0;
}

static void __exit kmm_crc_user_exit(void)
{
}

module_init(kmm_crc_user_init);
module_exit(kmm_crc_user_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kmm-fleet sample module depending on the in-tree crc-itu-t");
